"""Decode attention over a paged KV cache: Kvasir's split-K Triton kernel against the HBM bandwidth limit
and against torch's best attention over the same K/V gathered into a contiguous cache.

bf16, Llama-3-8B head layout (32 query heads, 8 KV heads, head dim 128), block size 16. Every
request has one query token and the same context length; its blocks lie at random places in the
pool. Kvasir reads the paged cache through the block table; torch reads a contiguous copy
(gathered beforehand, outside the timing: the ideal layout, which a paged server does not have).
Each candidate way of running torch's SDPA (backend x GQA handling) is tried and the fastest that
works is the baseline.

Achieved bandwidth = K and V bytes of every context token of every KV head / time. Goal:
>= 80% of peak for batch >= 16 and context >= 4k, and never slower than the torch baseline.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attention_bench import (
    MEMORY_HEADROOM,
    TorchAttention,
    add_common_arguments,
    finish_arguments,
    first_line,
    free_device_bytes,
    kernels_label,
    max_abs_diff,
    paged_bytes,
    rotation_copies,
    scattered_cache,
    select_device,
    time_per_call_ms,
    timing_note,
)
from _common import print_header, print_table
from _gpu import gpu_lines, peak_bandwidth_bytes_per_s

CANDIDATES = tuple(
    TorchAttention(backend, gqa)
    for gqa in ("folded", "enable_gqa", "expanded")
    for backend in ("flash", "efficient", "cudnn")
)
# bf16 outputs are averages of bf16 values: two correct kernels agree to about 1e-2.
TOLERANCE = 3e-2
BANDWIDTH_GOAL = 0.8
# Why each unsupported candidate was refused, the first time it was (printed under the tables).
REFUSALS: dict[str, str] = {}


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int


@dataclass
class Row:
    """One shape's figures; times in milliseconds, None where not measured."""

    shape: Shape
    kv_bytes: int
    kvasir_ms: float | None = None
    torch_ms: float | None = None
    torch_name: str = "-"
    timing: str = "-"
    diff: float | None = None
    note: str = ""
    candidates: dict[str, str] | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts = [1, 3], [17, 600]
    return finish_arguments(parser, args)


def measure(shape: Shape, args: argparse.Namespace, device: Any) -> Row:
    """Kvasir and every torch candidate on one shape; a row explaining why if the shape is skipped."""
    import torch

    from kvasir.kernels import AttentionWorkspace, paged_attention
    from kvasir.kernels.workspace import MAX_DECODE_SPLITS

    hq, hkv, dim, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    kv_bytes = 2 * shape.batch * shape.context * hkv * dim * 2
    row = Row(shape, kv_bytes)
    copies = rotation_copies(kv_bytes, device)
    need = paged_bytes(copies, shape.batch, shape.context, hkv, dim, bs) + copies * kv_bytes
    free = free_device_bytes(device)
    if free is not None and need > MEMORY_HEADROOM * free:
        row.note = f"skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return row

    generator = torch.Generator(device=device).manual_seed(args.seed)
    cache = scattered_cache(
        copies, shape.batch, shape.context, hkv, dim, bs, torch.bfloat16, device, generator
    )
    q = torch.randn(shape.batch, hq, dim, dtype=torch.bfloat16, device=device, generator=generator)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(shape.batch + 1, dtype=torch.int32, device=device)
    workspace = AttentionWorkspace(shape.batch, hq, dim, MAX_DECODE_SPLITS, device)
    scale = dim**-0.5

    def kvasir_call(copy: int) -> Any:
        return paged_attention(
            q,
            cache.k_cache,
            cache.v_cache,
            cache.block_tables[copy],
            seq_lens,
            query_start_loc,
            scale,
            max_query_len=1,
            max_seq_len=shape.context,
            workspace=workspace,
        )

    kvasir_out = kvasir_call(0).clone()
    row.kvasir_ms, row.timing = time_per_call_ms(
        [functools.partial(kvasir_call, c) for c in range(copies)], device, not args.no_graph
    )

    gathered = [cache.gather(c, shape.context) for c in range(copies)]
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    row.candidates = {}
    best: tuple[float, str, float] | None = None
    for candidate in CANDIDATES:
        if candidate.gqa == "expanded":
            extra = (hq // hkv) * copies * kv_bytes
            free = free_device_bytes(device)
            if free is not None and extra > MEMORY_HEADROOM * free:
                row.candidates[candidate.name] = "no memory"
                continue
        try:
            calls = [candidate.bind(q4, k, v, causal=False) for k, v in gathered]
        except Exception as error:  # any reason the backend refuses these inputs: it is not a candidate
            row.candidates[candidate.name] = "unsupported"
            REFUSALS.setdefault(candidate.name, first_line(error))
            continue
        diff = max_abs_diff(calls[0]().squeeze(2), kvasir_out)
        if diff > TOLERANCE:
            row.candidates[candidate.name] = f"differs by {diff:.3g}"
            continue
        ms, _ = time_per_call_ms(calls, device, not args.no_graph)
        row.candidates[candidate.name] = f"{ms * 1e3:.1f} us"
        if best is None or ms < best[0]:
            best = (ms, candidate.name, diff)
        del calls
    if best is not None:
        row.torch_ms, row.torch_name, row.diff = best
    return row


def goal_status(row: Row, peak: float | None, smoke: bool) -> str:
    if row.note:
        return row.note
    if row.kvasir_ms is None:
        return "-"
    if row.torch_ms is None:  # judged in smoke runs too: agreeing with torch is what they check
        differs = any(v.startswith("differs") for v in (row.candidates or {}).values())
        return (
            "MISMATCH: every working torch candidate differs from Kvasir" if differs else "no torch baseline"
        )
    if smoke:
        return "- (CPU smoke)"
    misses = []
    if peak and row.shape.batch >= 16 and row.shape.context >= 4096:
        fraction = row.kv_bytes / (row.kvasir_ms * 1e-3) / peak
        if fraction < BANDWIDTH_GOAL:
            misses.append(f"{fraction:.0%} < 80% of peak")
    if row.kvasir_ms > row.torch_ms:
        misses.append("slower than torch")
    return "MISS: " + ", ".join(misses) if misses else "ok"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = select_device(args.smoke)
    import torch

    torch.manual_seed(args.seed)
    print_header("decode attention over a paged KV cache")
    for line in gpu_lines():
        print(line)
    peak = peak_bandwidth_bytes_per_s(torch.cuda.get_device_name()) if device.type == "cuda" else None
    print(
        f"kernels: {kernels_label(device)}; bf16, {args.num_q_heads} q heads / {args.num_kv_heads} KV heads, "
        f"head dim {args.head_dim}, block size {args.block_size}, blocks scattered at random over the pool"
    )
    print(f"timing: {timing_note(device, args.no_graph)}")
    print(
        "torch reads a gathered contiguous copy (gather not timed); its baseline is its fastest "
        f"candidate whose output matches Kvasir's (max |diff| <= {TOLERANCE})\n"
    )
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            row = measure(Shape(batch, context), args, device)
            rows.append(row)
            print(
                f"  batch {batch:>4} x context {context:>6}: {goal_status(row, peak, args.smoke)}", flush=True
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    table = []
    for row in rows:
        kvasir_bw = row.kv_bytes / (row.kvasir_ms * 1e-3) if row.kvasir_ms else None
        torch_bw = row.kv_bytes / (row.torch_ms * 1e-3) if row.torch_ms else None
        table.append(
            [
                row.shape.batch,
                row.shape.context,
                row.kv_bytes / 2**20,
                _us(row.kvasir_ms),
                _gbs(kvasir_bw),
                _fraction(kvasir_bw, peak),
                row.torch_name,
                _us(row.torch_ms),
                _gbs(torch_bw),
                (row.torch_ms / row.kvasir_ms) if row.torch_ms and row.kvasir_ms else "-",
                row.diff if row.diff is not None else "-",
                row.timing,
                goal_status(row, peak, args.smoke),
            ]
        )
    print_table(
        [
            "batch",
            "context",
            "KV MiB",
            "Kvasir us",
            "Kvasir GB/s",
            "of peak",
            "torch best",
            "torch us",
            "torch GB/s",
            "torch time / Kvasir time",
            "max |diff|",
            "timed by",
            "goal",
        ],
        table,
    )
    names = [candidate.name for candidate in CANDIDATES]
    print("every torch candidate (time per call, or why it was left out):")
    print_table(
        ["batch", "context", *names],
        [[r.shape.batch, r.shape.context, *((r.candidates or {}).get(n, "-") for n in names)] for r in rows],
    )
    for name, reason in REFUSALS.items():
        print(f"{name} unsupported: {reason}")
    if args.smoke:
        print("CPU smoke run: the script works end to end; these are not GPU figures and no goal is judged.")
        return
    missed = [r for r in rows if goal_status(r, peak, False).startswith(("MISS", "no torch"))]
    skipped = [r for r in rows if r.note]
    print(
        f"goals (>= 80% of peak for batch >= 16 and context >= 4k; never slower than torch): "
        f"{len(rows) - len(missed) - len(skipped)} shapes ok, {len(missed)} missed, {len(skipped)} skipped"
    )


def _us(ms: float | None) -> Any:
    return ms * 1e3 if ms is not None else "-"


def _gbs(bytes_per_s: float | None) -> Any:
    return bytes_per_s / 1e9 if bytes_per_s is not None else "-"


def _fraction(bytes_per_s: float | None, peak: float | None) -> Any:
    return f"{bytes_per_s / peak:.0%}" if bytes_per_s is not None and peak else "-"


if __name__ == "__main__":
    main()
