"""GPU helpers the kernel and engine benchmarks share: device banner, peak bandwidth, CUDA timing.

Peak figures are the vendors' datasheet numbers (dense, no sparsity). A device missing from the
table prints no fraction of peak rather than a made-up one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

# (substring of torch.cuda.get_device_name(), HBM bytes/s, dense bf16 tensor FLOP/s)
_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM5; after the more specific H100 names
    ("H800", 3.35e12, 989e12),
    ("GH200", 4.0e12, 989e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40 GB
    ("L40S", 0.864e12, 362e12),
    ("L4", 0.3e12, 121e12),
    ("A10G", 0.6e12, 70e12),
)


def _lookup(device_name: str) -> tuple[float, float] | None:
    for key, bandwidth, flops in _PEAKS:
        if key.lower() in device_name.lower():
            return bandwidth, flops
    return None


def peak_bandwidth_bytes_per_s(device_name: str) -> float | None:
    """The device's HBM bandwidth from its datasheet, or None for a device not in the table."""
    peaks = _lookup(device_name)
    return peaks[0] if peaks else None


def peak_bf16_flops(device_name: str) -> float | None:
    """The device's dense bf16 tensor-core FLOP/s from its datasheet, or None if unknown."""
    peaks = _lookup(device_name)
    return peaks[1] if peaks else None


def gpu_lines() -> list[str]:
    """The GPU, its peaks and the software stack, for a benchmark's header."""
    import torch

    if not torch.cuda.is_available():
        return ["gpu: none (CPU run: figures are not GPU figures)"]
    name = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    bandwidth, flops = peak_bandwidth_bytes_per_s(name), peak_bf16_flops(name)
    peaks = (
        f"peak {bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} bf16 TFLOP/s (datasheet)"
        if bandwidth and flops
        else "peak unknown (not in benchmarks/_gpu.py)"
    )
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return [
        f"gpu: {name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; {peaks}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}",
    ]


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of `fn()` measured with CUDA events (wall clock on CPU, for smoke runs)."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
