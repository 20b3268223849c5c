"""GGUF weights kept packed: the loader's record of one tensor, and the kernels built from it.

`GGUFWeight` holds a tensor's raw blocks (uint8 [rows, bytes per row], rows already in Hugging
Face order) and its type name. At build time the blocks are decoded once into group-affine codes
(`gguf_blocks.decode_blocks`: codes, one scale and one offset per group) and packed for
`kvasir.kernels.group_affine`: 4-bit codes two per byte (Q4_0, Q4_1, Q4_K), 8-bit codes otherwise
(every other type: `gguf_blocks` has the table), row-major for the Triton kernel and the torch reference, tiled for the CPU C
kernel. The parts of one layer stack along rows into one kernel
whatever their types (a K-quant file keeps q and k in Q4_K or Q5_0 and v in Q6_K or Q8_0): parts
of different layouts are brought to a common one first, the widest codes and the smallest group
(a 4-bit code stored in 8 bits, a group's scale and offset repeated for each half), which changes
no value. So a merged projection stays one kernel, and the CPU decoder stack can bind it. The embedding
reads the same packed table: a lookup gathers the rows' codes and dequantizes only those rows, and
a tied LM head shares the table with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch
from torch import Tensor

from kvasir.kernels.cpu_ops.group_affine import TiledGemm
from kvasir.kernels.cpu_ops.group_affine_layout import TiledWeight, tile, tiled_rows, untile
from kvasir.kernels.group_affine import TiledLinear, describe_backend, group_affine_linear, tiles_on
from kvasir.kernels.reference.group_affine import GroupAffineWeight, dequantize, pack_codes
from kvasir.runtime.layers.quantization.gguf_blocks import BLOCK_TYPES, AffineGroups, decode_blocks
from kvasir.runtime.layers.quantization.weights import EmbeddingKernel, LinearKernel, QuantizedWeight

# The GGUF types kept packed; the loader dequantizes the others at load.
PACKED_GGUF_TYPES = tuple(BLOCK_TYPES)
# The bits CPU decode rounds each type's activations to (0: float32), per block of 32 values;
# docs/quantization.md has the measured logit error of each setting. 8 bits (llama.cpp's choice)
# turns the embedded SmolLM2's answer to "What is the capital of France?" into "L'Etoile, ...",
# as llama.cpp's own server answers; 16 bits keeps the float answers.
ACTIVATION_BITS = {type_name: 16 for type_name in PACKED_GGUF_TYPES}
ACTIVATIONS_ENV = "KVASIR_GGUF_CPU_ACTIVATIONS"
ACTIVATION_SETTINGS = {"float": 0, "int8": 8, "int16": 16}


class GGUFWeight(QuantizedWeight):
    """One GGUF tensor of a type in PACKED_GGUF_TYPES, as stored."""

    method = "gguf"

    def __init__(
        self,
        type_name: str,
        blocks: np.ndarray,
        shape: tuple[int, int],
        release: Callable[[], None] | None = None,
    ) -> None:
        """`release`, where `blocks` is a view of a mapped file: lets the file's pages of it go
        (called once the blocks are decoded for a build: a later read pages them back in)."""
        if type_name not in BLOCK_TYPES:
            raise ValueError(f"GGUF type {type_name} is not kept packed; supported: {', '.join(BLOCK_TYPES)}")
        per_block, block_bytes, _bits, _group = BLOCK_TYPES[type_name]
        if blocks.shape != (shape[0], shape[1] // per_block * block_bytes) or shape[1] % per_block:
            raise ValueError(f"{type_name} blocks of shape {blocks.shape} do not hold a {shape} tensor")
        self.type_name = type_name
        self.blocks = blocks
        self._shape = shape
        self._release = release
        self._packed: dict[torch.device, KernelWeight] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def scheme(self) -> str:
        return self.type_name

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def merge_key(self) -> Hashable:
        return ("gguf",)  # any GGUF types stack: `_common_layout` reconciles their codes

    def decode(self) -> AffineGroups:
        return decode_blocks(self.type_name, self.blocks)

    def _decoded_for_build(self) -> AffineGroups:
        """`decode`, then the file's pages of the blocks let go: a build's peak then holds the
        decoded codes and the packed ones, not the file's bytes as well (a 150k-token Q8_0 table:
        138 MiB)."""
        groups = self.decode()
        if self._release is not None:
            self._release()
        return groups

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.from_numpy(self.decode().dequantize()).to(dtype)

    def packed(self, device: torch.device) -> KernelWeight:
        """This tensor alone, packed for the kernels on `device` (built once: an embedding and the
        LM head tied to it share it)."""
        if device not in self._packed:
            self._packed[device] = _for_kernels([self._decoded_for_build()], device)
        return self._packed[device]

    @classmethod
    def build_linear(
        cls, parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
    ) -> LinearKernel:
        weights = [part for part in parts if isinstance(part, GGUFWeight)]
        if len(weights) != len(parts):
            raise TypeError("GGUFWeight.build_linear takes GGUFWeight parts only")
        if len(weights) == 1:
            packed = weights[0].packed(device)
        else:
            packed = _for_kernels(_common_layout([weight._decoded_for_build() for weight in weights]), device)
        type_names = list(dict.fromkeys(weight.type_name for weight in weights))
        return GGUFLinear(packed, type_names, device)

    def build_embedding(self, device: torch.device, dtype: torch.dtype) -> EmbeddingKernel:
        return GGUFEmbedding(self.packed(device), self.type_name, dtype)


# A weight as the kernels on its device read it: row-major packed, or tiled for the CPU C kernel.
KernelWeight = GroupAffineWeight | TiledWeight


def _common_layout(groups: list[AffineGroups]) -> list[AffineGroups]:
    """The parts in one layout: the most code bits and the smallest group among them. Exact: codes
    are one uint8 per value whatever their bits, and a group split in two keeps its scale and
    offset in both halves."""
    bits, group = max(g.bits for g in groups), min(g.group for g in groups)
    return [
        AffineGroups(
            codes=g.codes,
            scale=np.repeat(g.scale, g.group // group, axis=1),
            offset=np.repeat(g.offset, g.group // group, axis=1),
            bits=bits,
            group=group,
        )
        for g in groups
    ]


def _for_kernels(groups: list[AffineGroups], device: torch.device) -> KernelWeight:
    bits, group = groups[0].bits, groups[0].group

    def stacked(arrays: list[np.ndarray]) -> Tensor:  # one part: no copy (a large table's peak)
        return torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))

    codes = stacked([g.codes for g in groups])
    packed = GroupAffineWeight(
        codes=pack_codes(codes, bits, group),
        scale=stacked([g.scale for g in groups]),
        offset=stacked([g.offset for g in groups]),
        bits=bits,
        group=group,
    )
    return tile(packed) if tiles_on(device, bits, group) else packed.to(device)


def activation_bits(*type_names: str) -> int:
    """The bits the CPU kernel rounds the activations of a kernel over `type_names` to, 0 for
    float32 (read once per layer at load): `KVASIR_GGUF_CPU_ACTIVATIONS=float|int8|int16` for
    every type, else `ACTIVATION_BITS` (the most any of the types asks for)."""
    setting = os.environ.get(ACTIVATIONS_ENV, "auto").strip().lower()
    if setting == "auto":
        return max(ACTIVATION_BITS[type_name] for type_name in type_names)
    if setting not in ACTIVATION_SETTINGS:
        raise ValueError(f"{ACTIVATIONS_ENV} must be auto, {', '.join(ACTIVATION_SETTINGS)}; got {setting!r}")
    return ACTIVATION_SETTINGS[setting]


class GGUFLinear(LinearKernel):
    """`x @ W.T` with W kept as packed GGUF-derived codes (tiled on a CPU with the C kernel)."""

    codes: Tensor
    scale: Tensor
    offset: Tensor

    def __init__(self, weight: KernelWeight, type_names: Sequence[str], device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        # Buffers, so .to() moves them and the weights' bytes are counted with the model's.
        self.register_buffer("codes", weight.codes, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("offset", weight.offset, persistent=False)
        self.bits, self.group = weight.bits, weight.group
        self.tiled = isinstance(weight, TiledWeight)
        self.activation_bits = activation_bits(*type_names) if self.tiled else 0
        self._tiled_linear: TiledLinear | None = None  # bound to the buffers' addresses: see forward
        backend = describe_backend(device.type, weight.bits, weight.group, self.activation_bits)
        self._description = f"gguf {'+'.join(type_names)} ({weight.bits}-bit codes, {backend})"

    def _tiled_weight(self) -> TiledWeight:
        return TiledWeight(
            self.codes, self.scale, self.offset, self.bits, self.group, self.out_features, self.in_features
        )

    def weight(self) -> GroupAffineWeight:
        """The weight row-major packed (untiled: a copy where the layer keeps it tiled)."""
        if self.tiled:
            return untile(self._tiled_weight())
        return GroupAffineWeight(self.codes, self.scale, self.offset, self.bits, self.group)

    def forward(self, x: Tensor) -> Tensor:
        if not self.tiled:
            return group_affine_linear(x, self.weight())
        return self._bound()(x)

    def forward_wide(self, x: Tensor) -> Tensor:
        return self._bound().wide(x) if self.tiled else self.forward(x)

    def _bound(self) -> TiledLinear:
        bound = self._tiled_linear
        if bound is None:  # first call, or the buffers were replaced since (see `_apply`)
            bound = self._tiled_linear = TiledLinear(self._tiled_weight(), self.activation_bits)
        return bound

    def tiled_gemm(self) -> TiledGemm | None:
        return self._bound().gemm if self.tiled and self.codes.device.type == "cpu" else None

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> GGUFLinear:
        # `.to()`, `.float()` and the like may replace the buffers: the bound kernel holds the old
        # ones' addresses, so it is dropped here and bound again at the next call (rather than
        # comparing the buffers on each of the step's 121 calls).
        self._tiled_linear = None
        return super()._apply(fn, recurse)

    def describe(self) -> str:
        return self._description


class GGUFEmbedding(EmbeddingKernel):
    """Row lookup in a packed table: gathers the rows' codes, dequantizes those rows only."""

    codes: Tensor
    scale: Tensor
    offset: Tensor

    def __init__(self, weight: KernelWeight, type_name: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("codes", weight.codes, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("offset", weight.offset, persistent=False)
        self.bits, self.group, self.dtype = weight.bits, weight.group, dtype
        self.shape = (weight.out_features, weight.in_features)
        self.tiled = isinstance(weight, TiledWeight)
        self._description = f"gguf {type_name} (row lookup)"

    def forward(self, ids: Tensor) -> Tensor:
        if self.tiled:
            table = TiledWeight(self.codes, self.scale, self.offset, self.bits, self.group, *self.shape)
            rows = tiled_rows(table, ids.reshape(-1))
            return dequantize(rows, self.dtype).view(*ids.shape, self.shape[1])
        rows = GroupAffineWeight(self.codes[ids], self.scale[ids], self.offset[ids], self.bits, self.group)
        return dequantize(rows, self.dtype)

    def describe(self) -> str:
        return self._description
