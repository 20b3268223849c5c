"""Quantized linear layers on a GPU: a Llama-3-8B-shaped stack of projections in bf16, AWQ int4
(Kvasir's Triton dequant-GEMM) and FP8 (`torch._scaled_mm`), in the same run.

One pass is every projection of the 32 decoder layers (q/k/v 4096->6144, o 4096->4096, gate/up
4096->28672, down 14336->4096: 6.98 G weights), random weights made on the GPU (no checkpoint),
captured in one CUDA graph and replayed; median of the replays. Weight bytes are far larger than
L2, so every pass streams them from HBM. Rows per pass (`--batch`) stand for the tokens of a step:
1 is single-stream decode. Printed: ms per pass, speedup over bf16, weight bytes moved per
second, and the first layer's error against the reference computation of the same weights.

Modes: `bf16` (F.linear, cuBLAS); `awq-int4` (int4, groups of 128, Kvasir's kernel); `fp8-row`
(Kvasir's FP8 path: per-token activation scales from the Triton quantizer, per-channel weight
scales, Kvasir's Triton FP8 GEMM up to 64 rows and `_scaled_mm` row-wise beyond); `fp8-scaled-mm`
(the same with `_scaled_mm` at every batch, for comparison). Goals: awq-int4 >= 2x
bf16 at batch 1, FP8 >= 1.6x bf16 at batch 64.

`--sweep` also times the int4 GEMV's tile choices at batch 1 and the FP8 GEMM's at batch 64
(column tile, words per step), each pass against bf16, to show what the defaults were chosen from.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attention_bench import _capture
from _common import print_header, print_table
from _gpu import cuda_time_ms, gpu_lines, peak_bandwidth_bytes_per_s

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 32
# (name, out_features, in_features) of one Llama-3-8B decoder layer, merged as Kvasir runs them.
PROJECTIONS = (
    ("qkv", 6144, HIDDEN),
    ("o", HIDDEN, HIDDEN),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN),
    ("down", HIDDEN, INTERMEDIATE),
)
SMOKE = (("qkv", 96, 64), ("o", 64, 64), ("gate_up", 256, 64), ("down", 64, 128))
GROUP_SIZE = 128
MODES = ("bf16", "awq-int4", "fp8-row", "fp8-scaled-mm")
GOALS = {("awq-int4", 1): 2.0, ("fp8-row", 64): 1.6}


def build_layer(
    mode: str, out_features: int, in_features: int, seed: int, device: Any
) -> tuple[Callable[[Any], Any], Callable[[Any], Any], int]:
    """(run(x), reference(x), weight bytes) for one projection in `mode`."""
    import torch
    import torch.nn.functional as F

    from kvasir.kernels.fp8_linear import scaled_mm_linear
    from kvasir.kernels.int4_matmul import int4_matmul
    from kvasir.kernels.reference import fp8_linear as fp8_reference
    from kvasir.kernels.reference.int4_matmul import dequantize_int4

    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    if mode == "bf16":
        return (lambda x: F.linear(x, w)), (lambda x: F.linear(x.float(), w.float())), w.numel() * 2
    if mode == "awq-int4":
        group_size = min(GROUP_SIZE, in_features)
        groups = in_features // group_size
        qweight = torch.randint(
            -(2**31),
            2**31 - 1,
            (in_features // 8, out_features),
            generator=g,
            device=device,
            dtype=torch.int32,
        )
        scales = (torch.rand(groups, out_features, generator=g, device=device) * 0.004 + 0.001).bfloat16()
        zeros = torch.randint(0, 16, (groups, out_features), generator=g, device=device).bfloat16()
        nbytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel() * 2

        def run_int4(x: Any) -> Any:
            return int4_matmul(x, qweight, scales, zeros, group_size)

        run_int4.packed = (qweight, scales, zeros, group_size)  # type: ignore[attr-defined]
        return (
            run_int4,
            (lambda x: x.float() @ dequantize_int4(qweight, scales, zeros, group_size).float()),
            nbytes,
        )
    if mode == "fp8-row":
        amax = w.float().abs().amax(dim=1)
        scale = (amax / 448).contiguous()
        w8 = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
        return (
            (lambda x: scaled_mm_linear(x, w8, scale, None, None)),
            (lambda x: fp8_reference.fp8_linear(x, w8, scale, None, None).float()),
            w8.numel() + scale.numel() * 4,
        )
    if mode == "fp8-scaled-mm":
        amax = w.float().abs().amax(dim=1)
        scale = (amax / 448).contiguous()
        w8 = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
        w8_t, scale_row = w8.t(), scale.reshape(1, -1)

        def run(x: Any) -> Any:
            from kvasir.kernels.triton_ops.fp8_quant import quantize_per_token

            xq, x_scale = quantize_per_token(x)
            return torch._scaled_mm(xq, w8_t, scale_a=x_scale, scale_b=scale_row, out_dtype=torch.bfloat16)

        return (
            run,
            (lambda x: fp8_reference.fp8_linear(x, w8, scale, None, None).float()),
            w8.numel() + scale.numel() * 4,
        )
    if mode.startswith("int4-gemv"):  # int4-gemv:<block_n>:<block_w>:<warps>
        from kvasir.kernels.triton_ops.int4_matmul import gemv

        _, block_n, block_w, warps = mode.split(":")
        run_awq, reference, nbytes = build_layer("awq-int4", out_features, in_features, seed, device)
        packed = run_awq.packed  # type: ignore[attr-defined]
        return (lambda x: gemv(x, *packed, int(block_n), int(block_w), int(warps), 3)), reference, nbytes
    if mode.startswith("fp8-gemm"):  # fp8-gemm:<block_n>:<block_k>:<stages>
        from kvasir.kernels.triton_ops.fp8_gemm import fp8_gemm
        from kvasir.kernels.triton_ops.fp8_quant import quantize_per_token

        _, block_n, block_k, stages = mode.split(":")
        amax = w.float().abs().amax(dim=1)
        scale = (amax / 448).contiguous()
        w8 = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
        scale_row = scale.reshape(1, -1)

        def run_fp8(x: Any) -> Any:
            xq, x_scale = quantize_per_token(x)
            block_m = 16 if x.shape[0] <= 16 else 32 if x.shape[0] <= 32 else 64
            warps = 4 if block_m <= 32 else 8
            return fp8_gemm(
                xq, w8, x_scale, scale_row, (block_m, int(block_n), int(block_k), warps, int(stages))
            )

        return (
            run_fp8,
            (lambda x: fp8_reference.fp8_linear(x, w8, scale, None, None).float()),
            w8.numel() + scale.numel() * 4,
        )
    raise ValueError(mode)


def sweep_modes() -> list[tuple[str, list[int]]]:
    """(mode, batches) of the tile variants `--sweep` times."""
    gemv = [f"int4-gemv:{bn}:{tile // bn}:4" for bn in (8, 16, 32, 64) for tile in (2048, 4096)]
    fp8 = [f"fp8-gemm:{bn}:{bk}:{stages}" for bn in (32, 64, 128) for bk, stages in ((128, 5), (256, 4))]
    return [(mode, [1]) for mode in gemv] + [(mode, [64]) for mode in fp8]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' tile variants")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton's interpreter)")
    args = parser.parse_args(argv)
    import os

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("KVASIR_KERNELS", "triton")
    import torch

    print_header("Quantized linear layers: a Llama-3-8B-shaped projection stack", argv or sys.argv[1:])
    for line in gpu_lines():
        print(line)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = SMOKE if args.smoke else PROJECTIONS
    layers = 2 if args.smoke else args.layers
    peak = peak_bandwidth_bytes_per_s(torch.cuda.get_device_name()) if device.type == "cuda" else None
    rows: list[list[Any]] = []
    baseline: dict[int, float] = {}
    verdicts: list[str] = []
    plan = [(mode, args.batch) for mode in args.modes]
    if args.sweep and not args.smoke:
        plan += sweep_modes()
    for mode, batches in plan:
        try:
            built = [
                build_layer(mode, n, k, seed=layer * 10 + i, device=device)
                for layer in range(layers)
                for i, (_, n, k) in enumerate(shapes)
            ]
        except Exception as error:  # a variant that does not build is reported, not fatal
            rows.append(
                [mode, "-", float("nan"), float("nan"), float("nan"), float("nan"), f"failed: {error}"[:60]]
            )
            continue
        nbytes = sum(b for _, _, b in built)
        for batch in batches:
            g = torch.Generator(device=device).manual_seed(batch)
            inputs = {
                k: torch.randn(batch, k, generator=g, device=device, dtype=torch.bfloat16)
                for _, _, k in shapes
            }
            calls = [(run, inputs[k]) for (run, _, _), (_, _, k) in zip(built, shapes * layers, strict=True)]
            try:
                errors = []
                for (run, reference, _), (_, _, k) in zip(built[: len(shapes)], shapes, strict=True):
                    expected = reference(inputs[k])
                    errors.append(float((run(inputs[k]).float() - expected).norm() / expected.norm()))

                def one_pass(calls: list[tuple[Callable[[Any], Any], Any]] = calls) -> None:
                    for run, x in calls:
                        run(x)

                if device.type == "cuda":
                    graph = _capture(one_pass)
                    ms = cuda_time_ms(graph.replay if graph is not None else one_pass, warmup=3, iters=20)
                else:
                    ms = cuda_time_ms(one_pass, warmup=1, iters=2)
            except Exception as error:
                rows.append(
                    [
                        mode,
                        batch,
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        f"failed: {error}"[:60],
                    ]
                )
                continue
            if mode == "bf16":
                baseline[batch] = ms
            speedup = baseline[batch] / ms if batch in baseline else float("nan")
            bandwidth = nbytes / (ms / 1e3)
            rows.append(
                [
                    mode,
                    batch,
                    ms,
                    speedup,
                    bandwidth / 1e12,
                    bandwidth / peak if peak else float("nan"),
                    max(errors),
                ]
            )
            goal = GOALS.get((mode, batch))
            if goal is not None and batch in baseline:
                verdicts.append(
                    f"{mode} at batch {batch}: {speedup:.2f}x bf16 (goal >= {goal}x): {'MET' if speedup >= goal else 'NOT MET'}"
                )
            print(f"  {mode} batch {batch}: {ms:.3f} ms", flush=True)
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"{layers} layers, {len(shapes)} projections each; int4 in groups of {min(GROUP_SIZE, shapes[0][2])}"
    )
    print_table(
        ["mode", "batch", "ms/pass", "vs bf16", "weight TB/s", "of peak", "rel. error (layer 0)"], rows
    )
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
