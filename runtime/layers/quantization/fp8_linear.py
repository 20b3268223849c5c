"""FP8 weights as the loader hands them over (`Fp8CheckpointWeight`) and the kernel they run with.

On a GPU with FP8 tensor cores (compute capability 8.9+) the weight stays e4m3 in memory and runs
through `torch._scaled_mm` with per-token activation scales (`kvasir.kernels.fp8_linear`).

Everywhere else (CPUs, older GPUs) it is dequantized ONCE, at load, to the model's dtype, and runs
as a dense GEMM: the documented fallback. Two alternatives were measured and rejected on the CPU
(a 2048 x 2048 layer, one thread, one token): `torch._scaled_mm` runs on CPU tensors but took 25 ms
against 0.5 ms for float32 (and quantizes the activations too), and dequantizing on the fly at
every call took 12.5 ms. Dequantizing at load keeps the checkpoint's numbers exactly (e4m3 times its
scale is exact in float32) at the dense model's speed, for twice (bf16) or four times (fp32) the
FP8 weight memory.

`--quantization fp8` on a float checkpoint hands each projection's float tensor to
`online_fp8_weight`; the quantization itself (one scale per row) happens in `build_linear`, on the
model's device, where it is fast.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.fp8_linear import fp8_gemm_supported, scaled_mm_linear
from kvasir.runtime.layers.quantization.fp8 import Fp8Weight, quantize_weight, stack_outputs
from kvasir.runtime.layers.quantization.weights import DenseLinear, LinearKernel, QuantizedWeight

SCALED_MM_MULTIPLE = 16  # torch._scaled_mm needs in and out features divisible by 16


class Fp8CheckpointWeight(QuantizedWeight):
    """An FP8 linear weight: as the checkpoint stores it (`stored`), or a float weight that
    `--quantization fp8` quantizes when the layer is built (`float_weight`)."""

    method = "fp8"

    def __init__(
        self, stored: Fp8Weight | None = None, float_weight: Tensor | None = None, per_channel: bool = True
    ) -> None:
        if (stored is None) == (float_weight is None):
            raise ValueError("give exactly one of stored and float_weight")
        self.stored = stored
        self.float_weight = float_weight
        self.per_channel = per_channel

    def fp8(self, device: torch.device | None = None) -> Fp8Weight:
        """The FP8 weight on `device` (quantized there, for a float weight)."""
        if self.stored is not None:
            w = self.stored
            input_scale = None if w.input_scale is None else w.input_scale.to(device)
            return Fp8Weight(w.weight.to(device), w.scale.to(device), input_scale)
        assert self.float_weight is not None
        return quantize_weight(self.float_weight.to(device))

    @property
    def shape(self) -> tuple[int, int]:
        source = self.stored.weight if self.stored is not None else self.float_weight
        assert source is not None
        rows, cols = source.shape
        return int(rows), int(cols)

    @property
    def static(self) -> bool:
        return self.stored is not None and self.stored.input_scale is not None

    @property
    def scheme(self) -> str:
        scales = "per-channel" if self.per_channel else "per-tensor"
        activations = "static" if self.static else "per-token"
        origin = "" if self.stored is not None else ", quantized at load"
        return f"e4m3 {scales} scales, {activations} activations{origin}"

    @property
    def nbytes(self) -> int:
        out_features, in_features = self.shape
        return out_features * in_features + out_features * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.fp8().dequantize(dtype)

    @property
    def merge_key(self) -> Hashable:
        # Per-tensor and per-channel parts stack alike (one scale per row either way).
        return (self.method, self.static)

    @classmethod
    def build_linear(
        cls, parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
    ) -> LinearKernel:
        weights = [part.fp8(device) for part in parts if isinstance(part, Fp8CheckpointWeight)]
        if len(weights) != len(parts):
            raise TypeError("Fp8CheckpointWeight.build_linear got parts of other formats")
        weight = stack_outputs(weights)
        label = f"fp8 {parts[0].scheme}"
        out_features, in_features = weight.weight.shape
        fits = out_features % SCALED_MM_MULTIPLE == 0 and in_features % SCALED_MM_MULTIPLE == 0
        if fp8_gemm_runs(device) and fits:
            return Fp8Linear(weight, label)
        reason = "shape not a multiple of 16" if fp8_gemm_runs(device) else f"no FP8 GEMM on {device.type}"
        dtype_name = str(dtype).removeprefix("torch.")
        return DenseLinear(
            weight.dequantize(dtype), f"{label} (dequantized to {dtype_name} at load: {reason})"
        )


def fp8_gemm_runs(device: torch.device) -> bool:
    """Whether FP8 layers on `device` run the FP8 GEMM: a CUDA GPU with FP8 tensor cores and the
    Triton kernels on, or `KVASIR_KERNELS=triton` on CPU (tests: the GPU's code path, slowly)."""
    return use_triton(device) and (device.type != "cuda" or fp8_gemm_supported(device))


class Fp8Linear(LinearKernel):
    """x @ W.T with an e4m3 weight through the FP8 GEMMs of `kvasir.kernels.fp8_linear`."""

    weight: Tensor
    scale: Tensor
    input_scale: Tensor | None

    def __init__(self, weight: Fp8Weight, label: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.weight.shape
        self.register_buffer("weight", weight.weight)
        self.register_buffer("scale", weight.scale.reshape(1, -1).contiguous())
        self.register_buffer("input_scale", weight.input_scale)
        self._label = label

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        out = scaled_mm_linear(rows.contiguous(), self.weight, self.scale, self.input_scale, None)
        return out.reshape(*x.shape[:-1], self.out_features)

    def describe(self) -> str:
        return f"{self._label} (FP8 GEMM: Triton up to 64 rows, torch._scaled_mm beyond)"


def online_fp8_weight(tensor: Tensor) -> QuantizedWeight:
    """`--quantization fp8`: a float projection, to be quantized (one scale per row) at build."""
    return Fp8CheckpointWeight(float_weight=tensor)
