"""The model's projections: `Linear`, and `MergedLinear` for projections of one input run as one GEMM.

`q_proj`, `k_proj` and `v_proj` (or `gate_proj` and `up_proj`) read the same activations: one
matrix multiply over their stacked weights reads the input once and launches one kernel instead of
three (on a GPU the decode step is a few hundred launches; this removes two per layer).
Checkpoints keep their own names: `checkpoint_views` maps each of them to its rows of the stacked
parameter, and `CausalLM.load_weights` copies into those views.

In a quantized model (`quantized=True`) the weight is not allocated at construction (a "meta"
placeholder holds its shape): each part arrives through `load_part`, as a `QuantizedWeight` or a
plain tensor, and when the last one is in the layer builds its kernels once
(`build_linear_kernels`: parts of one format and storage type are stacked into one packed kernel,
so a merged layer stays one GEMM whenever the file stores its parts alike). Biases stay float
parameters and load through `checkpoint_views` as in a float model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvasir.runtime.layers.quantization.weights import (
    FloatWeight,
    LinearKernel,
    OnlineQuantizer,
    QuantizedWeight,
    build_linear_kernels,
)

if TYPE_CHECKING:
    from kvasir.kernels.cpu_ops.group_affine import TiledGemm


class Linear(nn.Linear):
    """nn.Linear whose weight, in a quantized model, is filled by `load_part` and run by kernels.

    `online_quantizable=False` keeps a layer in float when the model quantizes float weights at
    load (the LM head, as vLLM's dynamic FP8 does)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        quantized: bool = False,
        online_quantizable: bool = True,
    ) -> None:
        # The device and dtype the model is being built in (torch's defaults, set by the loader).
        self.target_device = torch.empty(0).device
        self.target_dtype = torch.get_default_dtype()
        super().__init__(in_features, out_features, bias=bias, device="meta" if quantized else None)
        if quantized and bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
        self.online_quantizable = online_quantizable
        self.kernels: nn.ModuleList | None = None
        # The one kernel's `forward` when a single kernel runs all parts without a bias: the decode
        # step's 121 GEMMs call it directly, skipping two module `__call__`s and the ModuleList.
        self._only_kernel: Callable[[Tensor], Tensor] | None = None
        self._pending: list[QuantizedWeight | None] | None = (
            [None] * len(self.output_sizes) if quantized else None
        )

    @property
    def output_sizes(self) -> tuple[int, ...]:
        return (self.out_features,)

    @property
    def deferred(self) -> bool:
        """True while a quantized model's weight is still to arrive through `load_part`."""
        return self._pending is not None

    def checkpoint_parts(self, path: str) -> dict[str, int]:
        """Checkpoint weight name -> part index, for the layer at module path `path`."""
        return {f"{path}.weight": 0}

    def load_part(
        self, index: int, weight: Tensor | QuantizedWeight, quantize: OnlineQuantizer | None = None
    ) -> str | None:
        """Take part `index`'s weight; build the kernels when all parts are in. Returns a problem
        (wrong shape) for the caller's error listing, or None."""
        if self._pending is None:
            raise RuntimeError("load_part on a layer that is not waiting for weights")
        expected = (self.output_sizes[index], self.in_features)
        if tuple(weight.shape) != expected:
            return f"expected {expected}, got {tuple(weight.shape)}"
        if isinstance(weight, Tensor):
            weight = (
                quantize(weight) if quantize is not None and self.online_quantizable else FloatWeight(weight)
            )
        self._pending[index] = weight
        if all(part is not None for part in self._pending):
            parts = [part for part in self._pending if part is not None]
            self.kernels = nn.ModuleList(build_linear_kernels(parts, self.target_device, self.target_dtype))
            if len(self.kernels) == 1 and self.bias is None:
                self._only_kernel = self.kernels[0].forward
            self._pending = None
            del self.weight  # the meta placeholder: the kernels hold the weight now
            self.register_parameter("weight", None)
        return None

    def forward(self, x: Tensor) -> Tensor:
        if self._only_kernel is not None:
            return self._only_kernel(x)
        if self.kernels is None:
            return nn.functional.linear(x, self.weight, self.bias)
        out = self._kernels_product(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: Tensor) -> Tensor:
        """x @ W^T without the bias, a fresh tensor (a row-parallel layer adds its bias once, after
        the ranks' partial products are summed)."""
        if self.kernels is None:
            return nn.functional.linear(x, self.weight)
        return self._kernels_product(x)

    def wide_product(self, x: Tensor) -> Tensor:
        """`product`, in float64 summed in float64 where the layer is one kernel that has that form
        (`LinearKernel.forward_wide`), else `product` itself."""
        kernels = self.kernels
        if kernels is not None and len(kernels) == 1 and isinstance(kernels[0], LinearKernel):
            return kernels[0].forward_wide(x)
        return self.product(x)

    def _kernels_product(self, x: Tensor) -> Tensor:
        kernels = self.kernels
        assert kernels is not None
        # One kernel for all parts is the common case (no list, no cat: a decode step runs 121).
        return kernels[0](x) if len(kernels) == 1 else torch.cat([kernel(x) for kernel in kernels], dim=-1)

    def tiled_gemm(self) -> TiledGemm | None:
        """The CPU C kernel that runs this layer's whole weight, where one does (a single packed
        kernel for all parts; a caller adds `bias` itself); None otherwise."""
        if self.kernels is None or len(self.kernels) != 1:
            return None
        kernel = self.kernels[0]
        return kernel.tiled_gemm() if isinstance(kernel, LinearKernel) else None

    def describe(self) -> list[str]:
        """What runs each run of parts: the kernels' descriptions, or the dense dtype."""
        if self.kernels is None:
            return [f"dense {str(self.weight.dtype).removeprefix('torch.')}"]
        return [kernel.describe() for kernel in self.kernels if isinstance(kernel, LinearKernel)]


class MergedLinear(Linear):
    """One linear layer standing for the checkpoint projections `parts` (name -> output size)."""

    def __init__(
        self, in_features: int, parts: dict[str, int], bias: bool = False, *, quantized: bool = False
    ) -> None:
        self.part_names = tuple(parts)
        self._output_sizes = tuple(parts.values())
        super().__init__(in_features, sum(parts.values()), bias=bias, quantized=quantized)

    @property
    def output_sizes(self) -> tuple[int, ...]:
        return self._output_sizes

    def forward_parts(self, x: Tensor) -> tuple[Tensor, ...]:
        """Each part's output [T, size]: views into one [T, total] result (rows strided, not copied)."""
        # split_with_sizes: `Tensor.split`'s Python wrapper costs more than the split (2 per layer).
        return self.forward(x).split_with_sizes(self.output_sizes, dim=-1)

    def checkpoint_parts(self, path: str) -> dict[str, int]:
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        return {f"{prefix}{name}.weight": index for index, name in enumerate(self.part_names)}

    def checkpoint_views(self) -> dict[str, Tensor]:
        """`{part}.weight` (and `{part}.bias`) -> the rows of the stacked parameter that part fills.
        A deferred (quantized) layer lists only its biases: its weights go through `load_part`."""
        views: dict[str, Tensor] = {}
        offset = 0
        for name, size in zip(self.part_names, self.output_sizes, strict=True):
            if self.kernels is None and not self.deferred:
                views[f"{name}.weight"] = self.weight.narrow(0, offset, size)
            if self.bias is not None:
                views[f"{name}.bias"] = self.bias.narrow(0, offset, size)
            offset += size
        return views

    def extra_repr(self) -> str:
        parts = ", ".join(
            f"{name}={size}" for name, size in zip(self.part_names, self.output_sizes, strict=True)
        )
        return f"in_features={self.in_features}, {parts}, bias={self.bias is not None}"
