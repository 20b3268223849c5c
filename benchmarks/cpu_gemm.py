"""The CPU packed GEMM that every GGUF weight runs through, on the embedded SmolLM2-135M's shapes:
the kernel of an older commit (compiled from its source, same flags) against this checkout's, with
float32, 16-bit and 8-bit activations, in one run, interleaved.

    python benchmarks/cpu_gemm.py                       # against 7544fd6, the kernel before tiling
    python benchmarks/cpu_gemm.py --baseline HEAD~3 --rows 1 8 --rounds 5
    python benchmarks/cpu_gemm.py --kernels best avx2 portable --activations int16 int8

`--kernels` adds the C code's other versions (`TiledGemm(kernel=...)`): `avx_vnni` and `avx2`,
what a CPU without AVX512-VNNI runs (Intel client CPUs; Zen 2/3 and other laptops), and
`portable`, the plain loops; a variant is then named
`<activations>:<kernel>` (`best` is this CPU's default and keeps the plain name).

Shapes (out x in) and how often one decode step runs each: q/k/v merged 960 x 576, o 576 x 576,
gate/up merged 3072 x 576, down 576 x 1536 (30 each: 4-bit codes in groups of 32, as Q4_1) and the
tied LM head 49152 x 576 (once: 8-bit codes, as Q8_0). Each layer shape has 30 distinct random
weights called in turn, so a pass streams 96-115 MiB of weights from memory as a real step does
(the L3 cache is 32 MiB here). Rows of x (`--rows`) stand for the tokens of a decode step: 1 is a
single stream. The baseline is called with its arguments prepared (x's group sums computed once),
this checkout's kernel as a layer calls it (`TiledGemm.run`): the per-call Python cost counts on
both sides, the baseline's being the smaller. Time is the calling thread's CPU time (one thread),
so a shared machine's descheduling does not count; each round runs every variant once per shape,
and the ratio to the baseline is taken within each round (median over rounds). The last table
sums one decode step: the 121 GEMMs, count-weighted.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table

from kvasir.kernels.cpu_ops import FLAGS
from kvasir.kernels.cpu_ops.group_affine import KERNELS
from kvasir.runtime.layers.quantization.gguf import ACTIVATION_SETTINGS as ACTIVATION_BITS

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "kernels/cpu_ops/group_affine_gemm.c"
# (name, out_features, in_features, code bits, calls per decode step)
SHAPES = (
    ("qkv", 960, 576, 4, 30),
    ("o", 576, 576, 4, 30),
    ("gate_up", 3072, 576, 4, 30),
    ("down", 576, 1536, 4, 30),
    ("lm_head", 49152, 576, 8, 1),
)


def baseline_library(revision: str, folder: Path) -> ctypes.CDLL:
    """The C kernel of `revision` (the row-major `group_affine_gemm_<bits>bit_g32` entry points)."""
    source = folder / "baseline.c"
    source.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{SOURCE}"], check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    target = folder / "baseline.so"
    subprocess.run(["cc", *FLAGS, str(source), "-o", str(target)], check=True)
    library = ctypes.CDLL(str(target))
    for bits in (4, 8):
        function = getattr(library, f"group_affine_gemm_{bits}bit_g32")
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        function.restype = None
    return library


def variant_names(activations: list[str], kernels: list[str]) -> list[str]:
    return ["baseline", *(a if k == "best" else f"{a}:{k}" for k in kernels for a in activations)]


def build_calls(
    shape: tuple[str, int, int, int, int],
    rows: int,
    baseline: ctypes.CDLL,
    copies: int,
    activations: list[str],
    kernels: list[str],
) -> dict[str, Callable[[], None]]:
    """variant -> a function running the shape's `copies` weights once each."""
    import torch

    from kvasir.kernels.cpu_ops.group_affine import TiledGemm
    from kvasir.kernels.cpu_ops.group_affine_layout import tile
    from kvasir.kernels.reference.group_affine import GroupAffineWeight, pack_codes

    _, n, k, bits, _ = shape
    g = torch.Generator().manual_seed(n + k)
    weights = []
    for _ in range(copies):
        codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
        # float16 values, as Q4_1 and Q8_0 store them (so the tiled kernel keeps them as float16)
        scale = (torch.rand((n, k // 32), generator=g) * 0.02).half().float()
        offset = (torch.randn((n, k // 32), generator=g) * 0.05).half().float()
        weights.append(GroupAffineWeight(pack_codes(codes, bits, 32), scale, offset, bits, 32))
    tiled = [tile(w) for w in weights]
    x = torch.randn(rows, k, generator=g)
    sums = x.view(rows, -1, 32).sum(-1).contiguous()
    out = torch.empty(rows, n)
    old = getattr(baseline, f"group_affine_gemm_{bits}bit_g32")

    def run_baseline() -> None:
        for w in weights:
            old(x.data_ptr(), sums.data_ptr(), w.codes.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(),
                out.data_ptr(), rows, n, k, 1)  # fmt: skip

    def run_tiled(activation_bits: int, kernel: str) -> Callable[[], None]:
        gemms = [TiledGemm(w, activation_bits, kernel=kernel) for w in tiled]  # bound once, as a layer does

        def run() -> None:
            for gemm in gemms:
                gemm.run(x)

        return run

    names = variant_names(activations, kernels)[1:]
    pairs = [(a, k) for k in kernels for a in activations]
    return {
        "baseline": run_baseline,
        **{name: run_tiled(ACTIVATION_BITS[a], k) for name, (a, k) in zip(names, pairs, strict=True)},
    }


def cpu_ms(run: Callable[[], None], calls: int) -> float:
    start = time.thread_time()
    run()
    return (time.thread_time() - start) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="7544fd6", help="the commit whose kernel is the baseline")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=30, help="distinct weights per layer shape")
    parser.add_argument(
        "--activations", nargs="+", default=list(ACTIVATION_BITS), choices=list(ACTIVATION_BITS)
    )
    parser.add_argument("--kernels", nargs="+", default=["best"], choices=list(KERNELS))
    args = parser.parse_args()
    variants = variant_names(args.activations, args.kernels)
    import torch

    torch.set_num_threads(1)
    print_header(f"CPU packed GEMM: the kernel of {args.baseline} against this checkout's", sys.argv)
    with tempfile.TemporaryDirectory() as folder:
        baseline = baseline_library(args.baseline, Path(folder))
        step: dict[int, dict[str, float]] = {}
        for rows in args.rows:
            table = []
            step[rows] = dict.fromkeys(variants, 0.0)
            for shape in SHAPES:
                copies = args.copies if shape[4] > 1 else 1
                calls = build_calls(shape, rows, baseline, copies, args.activations, args.kernels)
                for run in calls.values():
                    run()  # warm-up: page the weights in
                times: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(args.rounds):
                    for variant in variants:
                        times[variant].append(cpu_ms(calls[variant], copies))
                ratios = {v: statistics.median(b / t for b, t in zip(times["baseline"], times[v], strict=True))
                          for v in variants}  # fmt: skip
                medians = {v: statistics.median(times[v]) for v in variants}
                for v in variants:
                    step[rows][v] += medians[v] * shape[4]
                table.append([shape[0], f"{shape[1]}x{shape[2]}", *(medians[v] for v in variants),
                              *(ratios[v] for v in variants[1:])])  # fmt: skip
                del calls
            print(
                f"rows of x: {rows} (ms per call, CPU time; speedup = baseline / variant, median of rounds)"
            )
            print_table(["shape", "out x in", *(f"{v} ms" for v in variants),
                         *(f"{v} speedup" for v in variants[1:])], table)  # fmt: skip
            print()
    print("one decode step: 121 GEMMs (30 x each layer shape + the LM head), ms of CPU time")
    print_table(["rows", *variants, *(f"{v} speedup" for v in variants[1:])],
                [[rows, *(s[v] for v in variants), *(s["baseline"] / s[v] for v in variants[1:])]
                 for rows, s in step.items()])  # fmt: skip


if __name__ == "__main__":
    main()
