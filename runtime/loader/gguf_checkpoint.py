"""A GGUF file as a checkpoint: a Hugging Face config from its metadata, HF-named weights.

Matrices of every block type a common GGUF file holds (`PACKED_GGUF_TYPES`: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) are handed over packed, as
`GGUFWeight`s over the memory-mapped file's blocks; the model repacks them once for its kernels.
F16/BF16 matrices come as 16-bit tensors (`HalfWeight`: kept 16-bit, computed in float32), F32
ones as float32. What still runs dense in float32 (F32 matrices, a tensor-parallel slice that
splits a block) is counted and named in one log line at load. Types gguf-py cannot dequantize are
refused at open. llama.cpp's converter permutes the rows of q/k for the "llama" architecture (its
rotary pairs adjacent dimensions, Hugging Face's the two halves of each head); we permute them
back (on the blocks: GGUF blocks run along a row, so rows move whole).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvasir.runtime.allocator import release_free_memory
from kvasir.runtime.config import ModelConfig
from kvasir.runtime.layers.quantization.gguf import PACKED_GGUF_TYPES, GGUFWeight
from kvasir.runtime.layers.quantization.gguf_blocks import first_nonfinite_scale
from kvasir.runtime.layers.quantization.half import HalfWeight
from kvasir.runtime.loader import gguf_shards
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_file import GGUFFile, GGUFTensor
from kvasir.runtime.loader.gguf_tokenizer import tokenizer_from_gguf
from kvasir.runtime.loader.hf_config import finite_float, model_config_from_hf, positive_int
from kvasir.runtime.loader.tensor_index import check_tensor_index
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.parallel.partition import ShardMap, TensorShard

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_Q = GGMLQuantizationType
SUPPORTED_QUANT_TYPES = (
    *(_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1),
    *(_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ4_NL, _Q.IQ4_XS),
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_FLOAT_TYPES = (_Q.F32, _Q.F16, _Q.BF16)
_HALF_TYPES = (_Q.F16, _Q.BF16)
logger = logging.getLogger(__name__)

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ rope scaling, which llama.cpp stores as per-frequency divisors instead of metadata.
_ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


_HF_GLOBAL_NAMES = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
_HF_BLOCK_NAMES = {hf: gguf for gguf, hf in _BLOCK_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(?:(.+)\.(weight|bias))?")


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name (or of a layer's prefix `model.layers.N.`)."""
    if hf_name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf_name]
    match = _HF_LAYER.fullmatch(hf_name)
    if match is None:
        return hf_name
    if match[2] is None:
        return f"blk.{match[1]}."
    return f"blk.{match[1]}.{_HF_BLOCK_NAMES.get(match[2], match[2])}.{match[3]}"


class GGUFCheckpoint:
    """One GGUF file: metadata read once at open, tensors dequantized lazily by `iter_weights`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # Public for tools that need the raw file (tensor types, stored layouts).
            self.file = GGUFFile(path)
        except (ValueError, OSError) as error:  # GGUFFile validates magic, version and layout
            raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from error
        self.metadata = self.file.metadata
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.architecture: str = arch
        self._tensors = {tensor.name: tensor for tensor in self.file.tensors}
        self.hf_config = self._build_hf_config()  # first: it names what we refuse (e.g. experts)
        self._check_tensors()

    def model_config(self) -> ModelConfig:
        return model_config_from_hf(self.hf_config, source=str(self.path))

    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_gguf(self.metadata, self.path)

    def iter_weights(
        self, shards: ShardMap | None = None
    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight | HalfWeight]]:
        """`(hf_name, weight)` for every weight, one at a time: a `GGUFWeight` for a matrix of a
        packed type, a `HalfWeight` for an F16/BF16 matrix, else a float32 tensor. With `shards`
        (tensor parallelism), each sharded tensor comes as this rank's slice, cut from the file
        before decoding (`gguf_shards`). The matrices that arrive as float32 (and so run dense)
        are counted in one log line at the end.

        Once the consumer asks for the next weight, the file pages of every weight of the same
        layer handed over so far are let go: each has been repacked or copied by then, and a
        merged projection (q, k and v; gate and up) that decoded its earlier parts again when its
        last one arrived paged them back in from the page cache. So the file and the repacked
        weights are never resident together in full, and the load's peak holds at most one
        layer's file pages."""
        heads = int(self.hf_config["num_attention_heads"])
        kv_heads = int(self.hf_config["num_key_value_heads"])
        dense: dict[str, list[str]] = {}  # why a matrix runs dense in float32 -> tensor names
        dense_bytes = 0
        layer: list[GGUFTensor] = []  # the tensors of the current layer handed over so far
        for name, tensor in self._tensors.items():
            hf_name = hf_tensor_name(name)
            if hf_name is None:  # rope_freqs: already folded into the config
                continue
            row_heads = None
            if self.architecture == "llama" and ".self_attn.q_proj." in hf_name:
                row_heads = heads
            elif self.architecture == "llama" and ".self_attn.k_proj." in hf_name:
                row_heads = kv_heads
            shard = shards(hf_name) if shards is not None else None
            if shard is not None and row_heads is not None:
                # A rank's rows of q/k are whole heads: the permutation is undone per head.
                row_heads = row_heads * shard.size // int(tensor.shape[-1])
            weight = self._weight(tensor, shard, row_heads)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                split = tensor.tensor_type not in _FLOAT_TYPES
                reason = "split inside a block by tensor parallelism" if split else tensor.tensor_type.name
                dense.setdefault(reason, []).append(name)
                dense_bytes += weight.numel() * weight.element_size()
            if layer and _layer(layer[0].name) != _layer(name):
                layer = []
                # The last layer's repacking freed its transient copies into glibc's heap, which
                # keeps them resident; the next layer's fit in the same pages only in part.
                release_free_memory()
            layer.append(tensor)
            yield hf_name, weight
            for handed in layer:  # 90 MiB of a 0.5B Q4_K_M file's merged parts stayed otherwise
                self.file.release(handed)
        for tensor in self._tensors.values():  # a part still paged in by a later layer's build
            self.file.release(tensor)
        if dense:
            self._log_dense(dense, dense_bytes)

    def _log_dense(self, dense: dict[str, list[str]], dense_bytes: int) -> None:
        """The one line that says what was not kept packed: a warning where quantized blocks were
        dequantized, information where the file stored float32 matrices itself."""
        count = sum(len(names) for names in dense.values())
        reasons = ", ".join(f"{len(names)} {reason} (e.g. {names[0]!r})" for reason, names in dense.items())
        level = logging.INFO if set(dense) == {"F32"} else logging.WARNING
        logger.log(
            level,
            "%s: %d matrices (%.1f MiB) run dense in float32, not packed: %s",
            self.path.name,
            count,
            dense_bytes / 2**20,
            reasons,
        )

    def _weight(
        self, tensor: GGUFTensor, shard: TensorShard | None, row_heads: int | None
    ) -> torch.Tensor | GGUFWeight | HalfWeight:
        """One tensor (or this rank's slice of it) as `iter_weights` hands it over."""
        if tensor.tensor_type in _HALF_TYPES and len(tensor.shape) == 2:
            return HalfWeight(self._half_matrix(tensor, shard, row_heads))
        packed = self._packed(tensor)
        trim = None
        if packed is not None and shard is not None:
            packed, trim = gguf_shards.select(packed, tensor.tensor_type, shard)
        if packed is not None and trim is None:
            self._check_scales(tensor, packed)
            blocks = packed if row_heads is None else _unpermute_rows(packed, row_heads)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            if shard is not None:
                shape = tuple(shard.size if dim == shard.dim else size for dim, size in enumerate(shape))
            release = functools.partial(self.file.release, tensor)
            return GGUFWeight(tensor.tensor_type.name, blocks, (shape[0], shape[1]), release)
        values = self._dequantize(tensor) if shard is None else self._dequantize_shard(tensor, shard)
        if tensor.tensor_type not in _FLOAT_TYPES and not np.isfinite(values).all():
            raise self._corrupt_scales(tensor, int(np.flatnonzero(~np.isfinite(values))[0]))
        if row_heads is not None:
            values = _unpermute_rows(values, row_heads)
        return torch.from_numpy(values)

    @staticmethod
    def _half_matrix(tensor: GGUFTensor, shard: TensorShard | None, row_heads: int | None) -> torch.Tensor:
        """An F16/BF16 matrix (or this rank's slice) as a 16-bit tensor, copied out of the map
        (its pages are let go once the consumer has it)."""
        view = gguf_shards.rows_view(tensor.data, int(tensor.shape[1]))
        if shard is not None:  # one value per unit: a slice is never inside a block
            view, _ = gguf_shards.select(view, tensor.tensor_type, shard)
        if row_heads is not None:
            view = _unpermute_rows(view, row_heads)
        values = np.array(view)
        if tensor.tensor_type == _Q.BF16:  # stored as bytes: numpy has no bfloat16
            return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(values)

    def _dequantize_shard(self, tensor: GGUFTensor, shard: TensorShard) -> np.ndarray:
        """This rank's slice of `tensor` in float32, decoding only the blocks that hold it."""
        if len(tensor.shape) == 1:
            return np.ascontiguousarray(self._dequantize(tensor)[shard.start : shard.stop])
        view = gguf_shards.rows_view(tensor.data, int(tensor.shape[1]))
        selected, trim = gguf_shards.select(view, tensor.tensor_type, shard)
        values = np.asarray(dequantize(np.ascontiguousarray(selected), tensor.tensor_type), dtype=np.float32)
        if trim is not None:
            values = values[:, trim]
        return np.ascontiguousarray(values)

    def _check_scales(self, tensor: GGUFTensor, blocks: np.ndarray) -> None:
        """A NaN or infinite scale makes every output it touches NaN: refused at load, naming the
        tensor (one byte per block read: the blocks are paged in for the kernels next anyway)."""
        bad = first_nonfinite_scale(tensor.tensor_type.name, blocks)
        if bad is not None:
            per_block = GGML_QUANT_SIZES[tensor.tensor_type][0]
            raise self._corrupt_scales(tensor, bad * per_block)

    def _corrupt_scales(self, tensor: GGUFTensor, element: int) -> ModelLoadError:
        row, column = divmod(element, int(tensor.shape[0]))
        return ModelLoadError(
            f"{self.path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) has a NaN or infinite "
            f"scale (row {row}, from column {column}): the file is corrupt"
        )

    @staticmethod
    def _packed(tensor: GGUFTensor) -> np.ndarray | None:
        """The raw blocks [rows, bytes per row] of a matrix of a packed type, else None."""
        if tensor.tensor_type.name not in PACKED_GGUF_TYPES or len(tensor.shape) != 2:
            return None
        rows = int(tensor.shape[1])
        return np.asarray(tensor.data).reshape(rows, -1)

    def _dequantize(self, tensor: GGUFTensor) -> np.ndarray:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest first
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            values = values.reshape(shape)
        except (ValueError, NotImplementedError) as error:
            raise ModelLoadError(
                f"{self.path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) cannot be "
                f"dequantized ({error}); the file may be corrupt"
            ) from error
        # F32 tensors come back as views of the read-only memory map.
        return values if values.flags.writeable else values.copy()

    def _check_tensors(self) -> None:
        """Fail at open, not halfway through loading, on a tensor we cannot name or dequantize."""
        supported = ", ".join(t.name for t in SUPPORTED_QUANT_TYPES)
        for name, tensor in self._tensors.items():
            if hf_tensor_name(name) is None and name != _ROPE_FREQS:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} has no counterpart in a {self.architecture} model"
                )
            if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} uses quantization type {tensor.tensor_type.name}, "
                    f"which cannot be dequantized; supported: {supported}"
                )

    def _build_hf_config(self) -> dict[str, Any]:
        """The config.json transformers would derive from this file's metadata. Every number is
        checked first (a positive count, a finite float): a zero head count or a string where a
        size belongs is a ModelLoadError naming the key, not an arithmetic error later."""
        arch, meta = self.architecture, self.metadata

        def key(name: str, default: Any = None, *, required: bool = False) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None and required:
                raise ModelLoadError(f"{self.path}: GGUF metadata {arch}.{name} is missing")
            return value

        def count(name: str, default: Any = None, *, required: bool = False) -> int:
            where = f"{self.path}: GGUF metadata {arch}.{name}"
            return positive_int(_uniform(key(name, default, required=required), where), where)

        def number(name: str, default: float, minimum: float | None = None) -> float:
            return finite_float(
                key(name, default), f"{self.path}: GGUF metadata {arch}.{name}", minimum=minimum
            )

        if key("expert_count", 0):
            raise ModelLoadError(
                f"{self.path}: mixture-of-experts GGUF ({arch}.expert_count={key('expert_count')}) "
                "is not supported"
            )
        heads = count("attention.head_count", required=True)
        kv_heads = count("attention.head_count_kv", heads)
        hidden = count("embedding_length", required=True)
        if key("attention.key_length") is not None:
            head_dim = count("attention.key_length")
        else:
            head_dim = positive_int(
                hidden // heads, f"{self.path}: {arch}.embedding_length / {arch}.attention.head_count"
            )
        rotary_dim = key("rope.dimension_count")
        if rotary_dim is not None and count("rope.dimension_count") != head_dim:
            raise ModelLoadError(
                f"{self.path}: partial rotary ({arch}.rope.dimension_count={rotary_dim}, head_dim={head_dim}) "
                "is not supported"
            )
        rope_theta = number("rope.freq_base", 10000.0)
        config: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": self._vocab_size(),
            "hidden_size": hidden,
            "intermediate_size": count("feed_forward_length", required=True),
            "num_hidden_layers": count("block_count", required=True),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6, minimum=0.0),
            "rope_theta": rope_theta,
            "max_position_embeddings": count("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "rope_scaling": self._rope_scaling(rope_theta, head_dim),
        }
        return config

    def _vocab_size(self) -> int:
        """`<arch>.vocab_size`, else the number of tokens, else the embedding's rows."""
        where = f"{self.path}: GGUF metadata {self.architecture}.vocab_size"
        declared = self.metadata.get(f"{self.architecture}.vocab_size")
        if declared is not None:
            return positive_int(declared, where)
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and tokens:
            return len(tokens)
        embedding = self._tensors.get("token_embd.weight")
        if embedding is None or len(embedding.shape) != 2:
            raise ModelLoadError(
                f"{self.path}: no vocabulary size: neither {self.architecture}.vocab_size, "
                "tokenizer.ggml.tokens nor a token_embd.weight matrix"
            )
        return int(embedding.shape[1])

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's Hugging Face name and logical shape ([out, in]: GGUF lists dimensions
        fastest first), from the tensor table (no data read)."""
        shapes = {}
        for name, tensor in self._tensors.items():
            hf_name = hf_tensor_name(name)
            if hf_name is not None:
                shapes[hf_name] = tuple(int(d) for d in reversed(tensor.shape))
        return shapes

    def check_tensor_index(self, config: ModelConfig) -> None:
        """ModelLoadError unless the tensors are those of the model the metadata describes (layer
        count, vocabulary, hidden size, heads; `tensor_index`), before anything is allocated."""
        arch = self.architecture
        fields = {
            "num_hidden_layers": f"{arch}.block_count",
            "hidden_size": f"{arch}.embedding_length",
            "intermediate_size": f"{arch}.feed_forward_length",
            "num_attention_heads": f"{arch}.attention.head_count",
            "num_key_value_heads": f"{arch}.attention.head_count_kv",
            "head_dim": f"{arch}.attention.key_length"
            if f"{arch}.attention.key_length" in self.metadata
            else "head_dim",
            "vocab_size": f"{arch}.vocab_size"
            if f"{arch}.vocab_size" in self.metadata
            else "the vocabulary size",
        }
        check_tensor_index(
            config, self.tensor_shapes(), str(self.path), field_names=fields, stored_name=gguf_tensor_name
        )

    def _rope_scaling(self, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
        arch, meta = self.architecture, self.metadata
        kind = meta.get(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            scaling: dict[str, Any] = {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor")}
            original = meta.get(f"{arch}.rope.scaling.original_context_length")
            if original:
                scaling["original_max_position_embeddings"] = positive_int(
                    original, f"{self.path}: GGUF metadata {arch}.rope.scaling.original_context_length"
                )
            return scaling
        if _ROPE_FREQS not in self._tensors:
            return None
        factors = self._dequantize(self._tensors[_ROPE_FREQS]).reshape(-1)
        return llama3_scaling_from_freq_factors(factors, rope_theta, head_dim, self.path)


def _layer(gguf_name: str) -> str:
    """`blk.3` for every tensor of layer 3, the name itself for the others (token_embd, ...)."""
    return ".".join(gguf_name.split(".")[:2]) if gguf_name.startswith("blk.") else gguf_name


def llama3_scaling_from_freq_factors(
    factors: np.ndarray, rope_theta: float, head_dim: int, source: Path
) -> dict[str, Any] | None:
    """Recover Llama 3.1's `rope_scaling` from llama.cpp's `rope_freqs` tensor, or refuse."""
    if np.allclose(factors, 1.0):
        return None
    # Every Llama 3.x release uses these; only `factor` varies (8 for 3.1, 32 for 3.2).
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if factors.shape != (head_dim // 2,) or not np.allclose(
        factors, llama3_freq_factors(scaling, rope_theta, head_dim), rtol=1e-3
    ):
        raise ModelLoadError(
            f"{source}: tensor {_ROPE_FREQS!r} holds rope frequency factors that match no known "
            "Llama 3 rope scaling; this rope variant is not supported"
        )
    return scaling


def llama3_freq_factors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """The divisor llama3 rope scaling applies to each rotary frequency (llama.cpp's rope_freqs)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    middle = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, middle))


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute`: per head, rows (pairs interleaved) -> (halves)."""
    head_half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, head_half, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weight.shape))


def _uniform(value: Any, name: str) -> Any:
    """A per-layer array (some converters write one) must hold a single value for us."""
    if isinstance(value, list):
        if not value or len(set(map(repr, value))) != 1:
            shown = value if len(value) <= 8 else [*value[:8], "..."]
            raise ModelLoadError(f"{name} differs between layers ({shown}); not supported")
        value = value[0]
    return value
