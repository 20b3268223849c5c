"""Separate q/k/v and gate/up projections against one merged GEMM each, in the same run.

The runtime stacks the projections that read the same activations (`runtime/layers/linear.py`).
This times both forms of one decoder layer's input projections at real model shapes, on the CPU
(1 thread) or the GPU when there is one, and prints the merged form's speedup.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from _common import print_header, print_table
from _gpu import cuda_time_ms

# name: (hidden, q heads, kv heads, head dim, intermediate)
SHAPES = {
    "SmolLM2-135M": (576, 9, 3, 64, 1536),
    "Qwen3-0.6B": (1024, 16, 8, 128, 3072),
    "Llama-3-8B": (4096, 32, 8, 128, 14336),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--shapes", nargs="+", default=["SmolLM2-135M", "Qwen3-0.6B"], choices=list(SHAPES))
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_header("Merged vs separate input projections", sys.argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for shape in args.shapes:
        hidden, hq, hkv, d, inter = SHAPES[shape]
        g = torch.Generator(device=device).manual_seed(0)
        parts = {
            "q/k/v": [
                torch.randn(n, hidden, generator=g, device=device, dtype=dtype)
                for n in (hq * d, hkv * d, hkv * d)
            ],
            "gate/up": [
                torch.randn(inter, hidden, generator=g, device=device, dtype=dtype) for _ in range(2)
            ],
        }
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype)
            for label, weights in parts.items():
                merged = torch.cat(weights)
                separate_ms = cuda_time_ms(lambda: [F.linear(x, w) for w in weights], iters=args.iters)  # noqa: B023
                merged_ms = cuda_time_ms(lambda: F.linear(x, merged), iters=args.iters)  # noqa: B023
                rows.append([shape, label, tokens, separate_ms, merged_ms, separate_ms / merged_ms])
    print_table(["model", "projections", "tokens", "separate ms", "merged ms", "speedup"], rows)


if __name__ == "__main__":
    main()
