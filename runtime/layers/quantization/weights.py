"""What a loader hands a quantized model instead of a float tensor, and what a layer runs.

`QuantizedWeight` is one checkpoint weight in its stored, packed form (a GGUF tensor's blocks, an
FP8 tensor with its scales, AWQ/GPTQ `qweight`/`qzeros`/`scales`): plain CPU tensors, logical
shape `(out_features, in_features)`, a `dequantize()` that is the format's reference, and the two
builders a layer calls once all its parts have arrived:

- `build_linear(parts, device, dtype)` -> a `LinearKernel`: the (possibly merged) weight repacked
  once for its device's kernel, whose `forward(x)` is `x @ W.T` (bias is the layer's business);
- `build_embedding(device, dtype)` -> an `EmbeddingKernel` (row lookup), dense by default.

`FloatWeight` wraps a plain tensor that arrives for a layer of a quantized model (GGUF files keep
some tensors in F32/F16), so a merged layer can mix parts of several formats (see `merge_key`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from kvasir.kernels.cpu_ops.group_affine import TiledGemm


class LinearKernel(nn.Module, ABC):
    """`forward(x [T, in]) -> [T, out]` over a weight packed for one device; no bias."""

    in_features: int
    out_features: int

    @abstractmethod
    def describe(self) -> str:
        """What runs, for the startup log: e.g. `gguf Q4_1 (torch int4 packed, cpu)`."""

    def tiled_gemm(self) -> TiledGemm | None:
        """The CPU C kernel bound to this weight, where float32 calls run one (a C caller such as
        the decoder stack then calls it directly); None for every other kernel."""
        return None

    def forward_wide(self, x: Tensor) -> Tensor:
        """`forward`'s product for a row-parallel layer's partial sum: float64 summed in float64
        where the kernel has that form (the CPU's packed GEMM), else `forward`'s own."""
        return self.forward(x)


class EmbeddingKernel(nn.Module, ABC):
    """`forward(ids [T] int64) -> [T, hidden]` in the model's dtype."""

    @abstractmethod
    def describe(self) -> str: ...


class QuantizedWeight(ABC):
    """One checkpoint weight as stored: packed data plus what the format needs to read it."""

    # The `--quantization` name of the format ("gguf", "fp8", "awq", "gptq"; "float" for FloatWeight).
    method: ClassVar[str]

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """The logical (dequantized) shape: (out_features, in_features) for a linear weight."""

    @property
    @abstractmethod
    def scheme(self) -> str:
        """The storage type within the format, for logs and metrics: `Q4_K`, `e4m3 per-channel`, `int4 g128`."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the stored form takes (data and scales)."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The full-precision weight, `shape`, on CPU: the format's reference semantics."""

    @property
    def merge_key(self) -> Hashable:
        """Parts with equal keys can be stacked along rows into one kernel (same format and
        storage type); a merged layer runs one kernel per run of equal keys."""
        return (self.method, self.scheme)

    @classmethod
    @abstractmethod
    def build_linear(
        cls, parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
    ) -> LinearKernel:
        """One kernel for `parts` (all of this class, equal `merge_key`) stacked along the output
        rows in the given order; `dtype` is the activations' dtype."""

    def build_embedding(self, device: torch.device, dtype: torch.dtype) -> EmbeddingKernel:
        """A row lookup; the default dequantizes once (formats with a packed lookup override it)."""
        return DenseEmbedding(self.dequantize(dtype).to(device), f"{self.method} {self.scheme} (dequantized)")


class FloatWeight(QuantizedWeight):
    """A plain tensor in a quantized model: runs as a dense GEMM in the model's dtype."""

    method = "float"

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.tensor.shape
        return int(rows), int(cols)

    @property
    def scheme(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def merge_key(self) -> Hashable:
        return ("float",)  # any float dtypes stack: they are converted to the model's dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.tensor.to(dtype)

    @classmethod
    def build_linear(
        cls, parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
    ) -> LinearKernel:
        weight = torch.cat([part.dequantize(dtype) for part in parts]).to(device)
        return DenseLinear(weight, f"dense {str(dtype).removeprefix('torch.')}")


class DenseLinear(LinearKernel):
    """`x @ W.T` with a float weight: float parts, and the fallback of formats without a kernel."""

    def __init__(self, weight: Tensor, description: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self._description = description

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight)

    def describe(self) -> str:
        return self._description


class DenseEmbedding(EmbeddingKernel):
    def __init__(self, weight: Tensor, description: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self._description = description

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.weight)

    def describe(self) -> str:
        return self._description


def build_linear_kernels(
    parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
) -> list[LinearKernel]:
    """Kernels for a layer's parts in order: one per run of consecutive parts with equal `merge_key`
    (a GGUF file may keep q and k in Q4_K but v in Q6_K: two kernels, outputs concatenated)."""
    kernels: list[LinearKernel] = []
    start = 0
    for end in range(1, len(parts) + 1):
        if end == len(parts) or parts[end].merge_key != parts[start].merge_key:
            run = parts[start:end]
            kernels.append(type(run[0]).build_linear(run, device, dtype))
            start = end
    return kernels


# Turns a float weight into a quantized one at load (`--quantization fp8` on a float checkpoint).
OnlineQuantizer = Callable[[Tensor], QuantizedWeight]
