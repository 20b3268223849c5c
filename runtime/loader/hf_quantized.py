"""Quantized Hugging Face checkpoints (AWQ, GPTQ, FP8): component tensors gathered into one
`QuantizedWeight` per linear weight, as the checkpoint's safetensors are read.

A quantized projection `P` is stored as several tensors: AWQ's `P.qweight`, `P.qzeros`,
`P.scales`; GPTQ's the same plus `P.g_idx`; FP8's `P.weight` (float8) with `P.weight_scale` and,
for static activation scales, `P.input_scale`. `QuantizedCheckpoint.iter_weights` passes every
other tensor through unchanged (embeddings, norms, biases, the LM head, modules the checkpoint left
in float) and yields `(P.weight, QuantizedWeight)` as soon as P's tensors are all in, whatever order
and shards they come in: only incomplete projections are held.

Under tensor parallelism (`iter_weights(shards)`) each component is read as the slice that holds
this rank's rows or columns of the projection (`quantized_shards`), so a rank never reads the
other ranks' packed data.

Checkpoints quantized with an FP8 KV cache also carry its scales (`k_scale`, `v_scale`); Kvasir
sets KV scales with `--kv-cache-dtype` instead, so those tensors are skipped (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvasir.kernels.int4_packing import PACK
from kvasir.runtime.layers.quantization.awq import AwqConfig, AwqWeight
from kvasir.runtime.layers.quantization.fp8 import FP8_DTYPE, Fp8Config, fp8_from_checkpoint
from kvasir.runtime.layers.quantization.fp8_linear import Fp8CheckpointWeight
from kvasir.runtime.layers.quantization.gptq import GptqConfig, GptqWeight
from kvasir.runtime.layers.quantization.weights import QuantizedWeight
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.quantized_shards import COMPONENTS, component_shard, localize_g_idx
from kvasir.runtime.parallel.partition import ShardMap, TensorShard

logger = logging.getLogger(__name__)

KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".output_scale")


class _WeightSource(Protocol):
    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's name and shape, from the files' headers."""

    def iter_weights(self, shards: ShardMap | None = None) -> Iterator[tuple[str, Any]]: ...


class _Format(Protocol):
    """How one format names its components and builds its `QuantizedWeight`."""

    def component(self, suffix: str, tensor: torch.Tensor) -> bool:
        """Whether a tensor named `<prefix>.<suffix>` is part of a quantized weight."""

    def unused(self, suffix: str) -> bool:
        """Whether such a tensor is stored but not needed (skipped)."""

    def complete(self, parts: dict[str, torch.Tensor], at_end: bool) -> bool:
        """Whether `parts` hold all the weight needs (`at_end`: no more tensors will come)."""

    def build(self, parts: dict[str, torch.Tensor]) -> QuantizedWeight: ...

    # The `--quantization` name, its group size (-1: one group over all inputs; 0: none) and
    # whether its groups follow act-order: how a rank's slice of each component is cut.
    @property
    def method(self) -> str: ...
    @property
    def group_size(self) -> int: ...
    @property
    def desc_act(self) -> bool: ...


@dataclass(frozen=True)
class _Awq:
    config: AwqConfig
    method = "awq"
    desc_act = False

    @property
    def group_size(self) -> int:
        return self.config.group_size

    def component(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in ("qweight", "qzeros", "scales")

    def unused(self, suffix: str) -> bool:
        return False

    def complete(self, parts: dict[str, torch.Tensor], at_end: bool) -> bool:
        return len(parts) == 3

    def build(self, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        weight = AwqWeight(parts, self.config.group_size)
        weight.to_int4()  # checks the shapes now, so an error names the tensor while it is known
        return weight


@dataclass(frozen=True)
class _Gptq:
    config: GptqConfig
    method = "gptq"

    @property
    def group_size(self) -> int:
        return self.config.group_size

    @property
    def desc_act(self) -> bool:
        return self.config.desc_act

    def component(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in ("qweight", "qzeros", "scales", "g_idx")

    def unused(self, suffix: str) -> bool:
        return False

    def complete(self, parts: dict[str, torch.Tensor], at_end: bool) -> bool:
        # g_idx is optional (`k // group_size` without it) unless the checkpoint says act-order.
        required = 3 if at_end and not self.config.desc_act else 4
        return len(parts) >= required and {"qweight", "qzeros", "scales"} <= set(parts)

    def build(self, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        weight = GptqWeight(parts, self.config.group_size, self.config.zero_offset)
        weight.to_int4()
        return weight


@dataclass(frozen=True)
class _Fp8:
    config: Fp8Config
    method = "fp8"
    group_size = 0
    desc_act = False

    def component(self, suffix: str, tensor: torch.Tensor) -> bool:
        if suffix == "weight":
            return tensor.dtype == FP8_DTYPE  # float weights (norms, embeddings, ignored layers) pass
        return suffix in ("weight_scale", "input_scale")

    def unused(self, suffix: str) -> bool:
        # A dynamic scheme measures each token: an input_scale some writers still store is unused.
        return suffix == "input_scale" and not self.config.static_activations

    def complete(self, parts: dict[str, torch.Tensor], at_end: bool) -> bool:
        needed = {"weight", "weight_scale"} | ({"input_scale"} if self.config.static_activations else set())
        return needed <= set(parts)

    def build(self, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        input_scale = parts.get("input_scale")
        stored = fp8_from_checkpoint(parts["weight"], parts["weight_scale"], input_scale)
        return Fp8CheckpointWeight(stored=stored, per_channel=parts["weight_scale"].numel() > 1)


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A `WeightSource` over a quantized checkpoint's tensors (see the module docstring)."""

    weights: _WeightSource
    reader: _Format
    source: str

    def iter_weights(self, shards: ShardMap | None = None) -> Iterator[tuple[str, Any]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        skipped_kv_scales = 0
        stored = (
            self.weights.iter_weights()
            if shards is None
            else self.weights.iter_weights(self._stored_shards(shards))
        )
        for name, tensor in stored:
            prefix, _, suffix = name.rpartition(".")
            if name.endswith(KV_SCALE_SUFFIXES):
                skipped_kv_scales += 1
                continue
            if self.reader.unused(suffix):
                continue
            if (
                not isinstance(tensor, torch.Tensor)
                or not prefix
                or not self.reader.component(suffix, tensor)
            ):
                yield name, tensor
                continue
            if (
                suffix == "g_idx"
                and shards is not None
                and (logical := shards(f"{prefix}.weight")) is not None
            ):
                tensor = self._localize_g_idx(prefix, tensor, logical)
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if self.reader.complete(parts, at_end=False):
                yield f"{prefix}.weight", self._build(prefix, pending.pop(prefix))
        for prefix, parts in pending.items():
            if not self.reader.complete(parts, at_end=True):
                raise ModelLoadError(
                    f"{self.source}: the quantized weight {prefix} has only {', '.join(sorted(parts))}; "
                    "its other tensors are missing from the checkpoint"
                )
            yield f"{prefix}.weight", self._build(prefix, parts)
        if skipped_kv_scales:
            logger.info(
                "%s: skipped %d KV-cache scale tensors (set by --kv-cache-dtype here)",
                self.source,
                skipped_kv_scales,
            )

    def _stored_shards(self, shards: ShardMap) -> ShardMap:
        """`shards` (logical weight name -> slice) as the stored tensors' slices: a quantized
        projection's components are cut where they hold its rows or columns."""

        def shard(name: str) -> TensorShard | None:
            prefix, _, suffix = name.rpartition(".")
            logical = shards(f"{prefix}.weight") if prefix else None
            if logical is None or suffix not in COMPONENTS[self.reader.method]:
                return shards(name)
            try:
                return component_shard(
                    self.reader.method,
                    suffix,
                    logical,
                    self.reader.group_size,
                    self.weights.shapes.get(name, ()),
                )
            except ValueError as error:
                raise ModelLoadError(f"{self.source}: {name}: {error}") from error

        return shard

    def _localize_g_idx(self, prefix: str, g_idx: torch.Tensor, logical: TensorShard) -> torch.Tensor:
        try:
            return localize_g_idx(g_idx, logical, self.reader.group_size, self.reader.desc_act)
        except ValueError as error:
            raise ModelLoadError(f"{self.source}: {prefix}: {error}") from error

    def _build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        try:
            return self.reader.build(parts)
        except ValueError as error:
            raise ModelLoadError(f"{self.source}: {prefix}: {error}") from error


def logical_shapes(method: str | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` (a checkpoint's tensor headers) with each AWQ/GPTQ projection's packed `qweight`
    read as the `[out, in]` weight it holds (`P.weight`), for `tensor_index.check_tensor_index`.
    Other tensors keep their stored shapes (FP8 stores its weights unpacked)."""
    logical = dict(shapes)
    if method not in ("awq", "gptq"):
        return logical
    for name, shape in shapes.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "qweight" and len(shape) == 2:
            rows, cols = shape
            # AWQ: [in, out / 8]; GPTQ: [in / 8, out].
            logical[f"{prefix}.weight"] = (cols * PACK, rows) if method == "awq" else (cols, rows * PACK)
    return logical


def hf_quantized_weights(
    method: str, weights: _WeightSource, hf_config: dict[str, Any], config_path: Path
) -> QuantizedCheckpoint:
    """The reader of `method`'s tensors over `weights`; ModelLoadError naming config.json's field
    for a `quantization_config` Kvasir cannot run."""
    section = hf_config.get("quantization_config") or {}
    reader: _Format
    try:
        if method == "awq":
            reader = _Awq(AwqConfig.from_hf(section))
        elif method == "gptq":
            reader = _Gptq(GptqConfig.from_hf(section))
        elif method == "fp8":
            reader = _Fp8(Fp8Config.from_hf(section))
        else:
            raise ValueError(f"quantization_config declares {method}, which has no safetensors reader")
    except ValueError as error:
        raise ModelLoadError(f"{config_path}: {error}") from error
    return QuantizedCheckpoint(weights, reader, str(config_path.parent))
