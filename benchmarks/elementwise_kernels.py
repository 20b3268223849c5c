"""Triton vs torch eager vs torch.compile for the memory-bound elementwise ops of a decoder layer.

Ops (Llama-3-8B shapes by default): RMSNorm, RMSNorm fused with the residual add, the rotary
embedding of q and k (two launches, as the model makes them), and `silu(gate) * up`. For each
token count the three implementations run on the same inputs; the table shows the median time
(CUDA events), the bandwidth achieved on the bytes the op must move at least (every input read
once, every output written once), that as a fraction of the device's datasheet peak, which is
fastest, and how far Triton's output is from the eager reference's.

Small token counts move a few kilobytes: their times are launch latency, host overhead included
(the model runner's CUDA graphs take that away), not bandwidth. Needs a CUDA GPU; `--smoke` runs
tiny shapes on CPU with the kernels in Triton's interpreter, to check that the script works.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import print_header, print_table
from _gpu import cuda_time_ms, gpu_lines, peak_bandwidth_bytes_per_s

EPS = 1e-5
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tokens: tuple[int, ...]


LLAMA3_8B = Shapes(4096, 14336, 32, 8, 128, (1, 16, 256, 4096, 16384))
SMOKE = Shapes(64, 96, 4, 2, 16, (1, 5))


@dataclass(frozen=True)
class Case:
    """One op at one size: the three implementations as thunks, and the bytes it must move."""

    min_bytes: int
    triton: Callable[[], Any]
    eager: Callable[[], Any]
    compiled: Callable[[], Any] | None


def first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def build_ops(compile_reference: bool) -> dict[str, Callable[[Shapes, int, torch.dtype, torch.device], Case]]:
    """Each op's case builder; imported here, after TRITON_INTERPRET is settled."""
    from kvasir.kernels.reference import activation as ref_activation
    from kvasir.kernels.reference import norm as ref_norm
    from kvasir.kernels.reference import rotary as ref_rotary
    from kvasir.kernels.triton_ops import activation as tri_activation
    from kvasir.kernels.triton_ops import norm as tri_norm
    from kvasir.kernels.triton_ops import rotary as tri_rotary

    def rotary_qk(apply: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        def run(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
            return apply(q, cos, sin), apply(k, cos, sin)

        return run

    eager: dict[str, Callable[..., Any]] = {
        "rms_norm": ref_norm.rms_norm,
        "fused_add_rms_norm": ref_norm.fused_add_rms_norm,
        "rotary_qk": rotary_qk(ref_rotary.apply_rotary),
        "silu_and_mul": ref_activation.silu_and_mul,
    }
    triton: dict[str, Callable[..., Any]] = {
        "rms_norm": tri_norm.rms_norm,
        "fused_add_rms_norm": tri_norm.fused_add_rms_norm,
        "rotary_qk": rotary_qk(tri_rotary.apply_rotary),
        "silu_and_mul": tri_activation.silu_and_mul,
    }
    # One compiled function per op, specialised (dynamic=False) to each token count it meets:
    # the fastest code inductor makes for a fixed shape, recompiled per size outside the timing.
    compiled: dict[str, Callable[..., Any]] = (
        {name: torch.compile(fn, dynamic=False) for name, fn in eager.items()} if compile_reference else {}
    )

    def make(name: str, args: tuple[Any, ...], min_bytes: int) -> Case:
        fn = compiled.get(name)
        return Case(
            min_bytes,
            lambda: triton[name](*args),
            lambda: eager[name](*args),
            None if fn is None else (lambda: fn(*args)),
        )

    def rand(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.randn(shape, device=device).to(dtype)

    def rms_norm(s: Shapes, t: int, dtype: torch.dtype, device: torch.device) -> Case:
        size = dtype.itemsize
        x, w = rand(t, s.hidden, dtype=dtype, device=device), rand(s.hidden, dtype=dtype, device=device)
        return make("rms_norm", (x, w, EPS), (2 * t + 1) * s.hidden * size)

    def fused_add_rms_norm(s: Shapes, t: int, dtype: torch.dtype, device: torch.device) -> Case:
        size = dtype.itemsize
        x, r = (rand(t, s.hidden, dtype=dtype, device=device) for _ in range(2))
        w = rand(s.hidden, dtype=dtype, device=device)
        return make("fused_add_rms_norm", (x, r, w, EPS), (4 * t + 1) * s.hidden * size)

    def rotary(s: Shapes, t: int, dtype: torch.dtype, device: torch.device) -> Case:
        q = rand(t, s.num_heads, s.head_dim, dtype=dtype, device=device)
        k = rand(t, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
        angles = torch.rand(t, 1, s.head_dim // 2, device=device) * 100
        cos, sin = angles.cos(), angles.sin()  # float32, as RotaryEmbedding hands them out
        qk_bytes = 2 * t * (s.num_heads + s.num_kv_heads) * s.head_dim * dtype.itemsize
        return make("rotary_qk", (q, k, cos, sin), qk_bytes + 2 * cos.numel() * cos.element_size())

    def silu_and_mul(s: Shapes, t: int, dtype: torch.dtype, device: torch.device) -> Case:
        gate, up = (rand(t, s.intermediate, dtype=dtype, device=device) for _ in range(2))
        return make("silu_and_mul", (gate, up), 3 * t * s.intermediate * dtype.itemsize)

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_qk": rotary,
        "silu_and_mul": silu_and_mul,
    }


def measure(case: Case, warmup: int, iters: int) -> dict[str, float]:
    """Median milliseconds of each implementation (NaN for one not run)."""
    times = {
        "triton": cuda_time_ms(case.triton, warmup, iters),
        "eager": cuda_time_ms(case.eager, warmup, iters),
    }
    times["compile"] = float("nan") if case.compiled is None else cuda_time_ms(case.compiled, warmup, iters)
    return times


def max_diff(case: Case) -> float:
    """Largest |Triton - eager reference| over the op's first output."""
    return (first(case.triton()).float() - first(case.eager()).float()).abs().max().item()


def op_rows(
    build: Callable[[Shapes, int, torch.dtype, torch.device], Case],
    shapes: Shapes,
    dtype: torch.dtype,
    device: torch.device,
    args: argparse.Namespace,
    peak: float | None,
) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for tokens in shapes.tokens:
        case = build(shapes, tokens, dtype, device)
        diff = max_diff(case)
        times = measure(case, args.warmup, args.iters)
        row: list[Any] = [tokens, case.min_bytes / 1e6]
        for impl in ("triton", "eager", "compile"):
            ms = times[impl]
            gbps = case.min_bytes / (ms * 1e-3) / 1e9
            row += [ms * 1e3, gbps, 100 * gbps * 1e9 / peak if peak else float("nan")]
        ran = {impl: ms for impl, ms in times.items() if ms == ms}
        row += [min(ran, key=ran.__getitem__), times["eager"] / times["triton"], diff]
        rows.append(row)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


HEADERS = [
    "tokens",
    "MB moved",
    "triton us",
    "triton GB/s",
    "triton % peak",
    "eager us",
    "eager GB/s",
    "eager % peak",
    "compile us",
    "compile GB/s",
    "compile % peak",
    "fastest",
    "eager/triton",
    "max |diff|",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default: 1 16 256 4096 16384)")
    parser.add_argument(
        "--ops", nargs="+", help="a subset of rms_norm fused_add_rms_norm rotary_qk silu_and_mul"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100, help="timed runs per point; the median is shown")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, 2 runs each; on CPU in Triton's interpreter"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            sys.exit("this benchmark needs a CUDA GPU (--smoke checks the script on CPU with tiny shapes)")
        # Triton reads this when the kernels are defined, i.e. when build_ops imports them.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE if args.smoke else LLAMA3_8B
    if args.tokens:
        shapes = Shapes(**{**shapes.__dict__, "tokens": tuple(args.tokens)})
    if args.smoke:
        args.warmup, args.iters = 1, 2
    dtype = DTYPES[args.dtype]
    ops = build_ops(compile_reference=not args.no_compile)
    unknown = set(args.ops or ()) - set(ops)
    if unknown:
        sys.exit(f"unknown op(s) {', '.join(sorted(unknown))}; choose from {', '.join(ops)}")

    print_header("Elementwise kernels: Triton vs torch eager vs torch.compile")
    for line in gpu_lines():
        print(line)
    peak = peak_bandwidth_bytes_per_s(torch.cuda.get_device_name()) if device.type == "cuda" else None
    print(
        f"shapes: hidden {shapes.hidden}, intermediate {shapes.intermediate}, {shapes.num_heads} q + "
        f"{shapes.num_kv_heads} kv heads of {shapes.head_dim}; {args.dtype}; "
        f"median of {args.iters} runs after {args.warmup} warmup"
    )
    print("MB moved: inputs read once + outputs written once; GB/s and % of peak are on that figure")
    print()
    for name, build in ops.items():
        if args.ops and name not in args.ops:
            continue
        print(f"### {name}")
        print_table(HEADERS, op_rows(build, shapes, dtype, device, args, peak))


if __name__ == "__main__":
    main()
