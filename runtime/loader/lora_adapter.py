"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`), read as
untrusted input and checked against the base model before any weight is used.

Everything a client can put in the directory is bounded before it is read: the config's size, the
safetensors header's length (against the file's size), the weight file's size (against the
largest adapter this model and `max_lora_rank` allow), each tensor's name, dtype, shape and byte
range. Anything the runtime cannot serve exactly as PEFT would run it (DoRA, trained biases,
`modules_to_save`, embedding or LM-head targets, per-module ranks) is refused, never approximated.
Every failure is a `LoRAAdapterError` with a one-line message naming the file and field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.lora.errors import LoRAAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
# The seven projections an adapter may target, each with (input, output) sizes from the config.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# PEFT's names: base_model.model.model.layers.N.(self_attn|mlp).<module>.lora_(A|B)[.<adapter>].weight
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
# Config fields whose non-default value changes the computation in a way this runtime does not do.
_REFUSED_IF_SET = {
    "use_dora": "DoRA adapters are not supported",
    "lora_bias": "adapters with trained LoRA biases are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter, in host memory: per (layer, module) its A [r, in] and B [out, r]."""

    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: bytes

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (in_features, out_features) in the base model."""
    hidden, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out, inter = config.num_key_value_heads * config.head_dim, config.intermediate_size
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_digest(config_bytes: bytes, weight_bytes: bytes) -> bytes:
    """SHA-256 over both files' bytes, each length-prefixed so no split of one stream aliases another."""
    digest = hashlib.sha256()
    for part in (config_bytes, weight_bytes):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def read_adapter_digest(path: str | Path, config: ModelConfig, max_rank: int) -> bytes:
    """The digest of the adapter at `path` (its files bounded as `load_lora_adapter` bounds them),
    without parsing the weights: what a `LoRARequest` carries before the worker loads it."""
    folder = Path(path)
    config_bytes = _read_config_bytes(folder)
    return adapter_digest(config_bytes, _read_weight_bytes(folder, _max_weight_bytes(config, max_rank)))


def load_lora_adapter(
    path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check the adapter at `path` against the base model `config`; tensors in `dtype` on
    the CPU. Raises LoRAAdapterError (one line) for anything that cannot be served exactly."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"adapter path {folder.name!r} is not a directory")
    config_bytes = _read_config_bytes(folder)
    rank, scaling, targets = _parse_config(config_bytes, max_rank)
    weight_bytes = _read_weight_bytes(folder, _max_weight_bytes(config, max_rank))
    weights = _parse_weights(weight_bytes, config, rank, targets, dtype)
    return LoRAAdapter(rank, scaling, weights, adapter_digest(config_bytes, weight_bytes))


def _read_config_bytes(folder: Path) -> bytes:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"{CONFIG_FILE}: not found in the adapter directory")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
    with file.open("rb") as handle:
        return handle.read(MAX_CONFIG_BYTES + 1)[:MAX_CONFIG_BYTES]


def _max_weight_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest weight file a valid adapter can be: every module at max_rank in float32, plus
    the largest header allowed."""
    per_layer = sum(max_rank * (n_in + n_out) for n_in, n_out in module_shapes(config).values())
    return 8 + MAX_HEADER_BYTES + 4 * per_layer * config.num_hidden_layers


def _read_weight_bytes(folder: Path, limit: int) -> bytes:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        if (folder / "adapter_model.bin").exists():
            raise LoRAAdapterError(
                "adapter_model.bin: pickled weights are not read (they can run code); "
                f"save the adapter as {WEIGHTS_FILE} (PEFT's default)"
            )
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: not found in the adapter directory")
    size = file.stat().st_size
    if size > limit:
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE}: {size} bytes, more than an adapter of this model at the maximum rank can be"
        )
    with file.open("rb") as handle:
        return handle.read(limit + 1)[:limit]


def _parse_config(raw: bytes, max_rank: int) -> tuple[int, float, list[str] | str]:
    """(rank, scaling, target_modules) from adapter_config.json, refusing what cannot run exactly."""
    try:
        fields = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(f"{CONFIG_FILE}: not valid JSON ({_one_line(error)})") from None
    if not isinstance(fields, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE}: expected a JSON object")
    peft_type = fields.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(
            f"{CONFIG_FILE}: 'peft_type' is {_short(peft_type)}, only LORA adapters are served"
        )
    for name, why in _REFUSED_IF_SET.items():
        if fields.get(name) not in (None, False, {}, [], ""):
            raise LoRAAdapterError(f"{CONFIG_FILE}: '{name}' is set: {why}")
    if fields.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"{CONFIG_FILE}: 'bias' is {_short(fields['bias'])}: only \"none\" is supported"
        )
    rank = fields.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'r' must be a positive integer, got {_short(rank)}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'r' is {rank}, more than --max-lora-rank {max_rank}")
    alpha = fields.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'lora_alpha' must be a finite number, got {_short(alpha)}")
    rslora = fields.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'use_rslora' must be true or false, got {_short(rslora)}")
    # rsLoRA (Kalajdzievski 2023) scales by alpha / sqrt(r), PEFT's default by alpha / r.
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return rank, float(scaling), _check_targets(fields.get("target_modules"))


def _check_targets(targets: Any) -> list[str] | str:
    """target_modules as PEFT writes it: a list of module names, a regex, or "all-linear"."""
    refused = ("embed_tokens", "lm_head")
    if isinstance(targets, str):
        if targets == "all-linear":
            return list(TARGET_MODULES)
        # A regex is never run here: a client's pattern could backtrack for ever. The tensors' own
        # names say which modules it targeted, and those are checked one by one.
        if len(targets) > 4096 or any(name in targets for name in refused):
            raise LoRAAdapterError(
                f"{CONFIG_FILE}: 'target_modules' regex names the embedding or LM head, or is too long"
            )
        return targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'target_modules' must be a list of module names or a regex")
    for target in targets:
        leaf = target.rpartition(".")[2]
        if leaf in refused:
            raise LoRAAdapterError(
                f"{CONFIG_FILE}: 'target_modules' names {leaf!r}: only q, k, v, o, gate, up and down projections are served"
            )
        if leaf not in TARGET_MODULES:
            raise LoRAAdapterError(
                f"{CONFIG_FILE}: 'target_modules' names {_short(target)}, not one of {', '.join(TARGET_MODULES)}"
            )
    return targets


def _targeted(targets: list[str] | str, layer: int, parent: str, module: str) -> bool:
    """Whether PEFT would have put a LoRA on this module under `targets`."""
    if isinstance(targets, str):  # a regex: not run (see _check_targets); the tensor names decide
        return True
    return any(t == module or t.endswith(f".{module}") for t in targets)


def _parse_weights(
    raw: bytes, config: ModelConfig, rank: int, targets: list[str] | str, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor of the safetensors bytes checked by name, dtype, shape, byte range and value."""
    header, data = _split_safetensors(raw)
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    previous_end = 0
    for name, entry in sorted(header.items(), key=lambda item: _begin(item[1])):
        if name == "__metadata__":
            continue
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: tensor {_short(name)} is not a LoRA A/B weight of a q, k, v, o, gate, up or down projection"
            )
        layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in shapes or _PARENT.get(module, "mlp") != parent:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: tensor {_short(name)} targets an unsupported module")
        if layer >= config.num_hidden_layers:
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: tensor {_short(name)} is for layer {layer}; the model has {config.num_hidden_layers}"
            )
        if not _targeted(targets, layer, parent, module):
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: tensor {_short(name)} is for a module 'target_modules' does not name"
            )
        if half in halves.get((layer, module), {}):
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: two lora_{half} tensors for layer {layer} {module}")
        n_in, n_out = shapes[module]
        expected = (rank, n_in) if half == "A" else (n_out, rank)
        tensor, previous_end = _tensor(name, entry, data, expected, previous_end)
        converted = tensor.to(dtype)
        if converted.dtype == torch.float16 and not bool(torch.isfinite(converted).all()):
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: tensor {_short(name)} holds values beyond float16's range (--lora-dtype float16)"
            )
        halves.setdefault((layer, module), {})[half] = converted
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: layer {layer} {module} has no lora_{missing} tensor")
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: holds no LoRA weights")
    return weights


def _split_safetensors(raw: bytes) -> tuple[dict[str, Any], memoryview]:
    """(header, data) of a safetensors file, the header's length checked against the file's."""
    if len(raw) < 8:
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: too short to be a safetensors file")
    length = int.from_bytes(raw[:8], "little")
    if length > MAX_HEADER_BYTES or 8 + length > len(raw):
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE}: header length {length} does not fit the file ({len(raw)} bytes)"
        )
    try:
        header = json.loads(raw[8 : 8 + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: header is not valid JSON ({_one_line(error)})") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: header is not a JSON object of tensor entries")
    return header, memoryview(raw)[8 + length :]


def _begin(entry: dict[str, Any]) -> int:
    """A tensor's first byte, for ordering (-1 where the entry has none: it fails its own check)."""
    offsets = entry.get("data_offsets")
    if isinstance(offsets, list) and offsets and isinstance(offsets[0], int):
        return offsets[0]
    return -1


def _tensor(
    name: str, entry: dict[str, Any], data: memoryview, expected: tuple[int, int], previous_end: int
) -> tuple[torch.Tensor, int]:
    """One tensor's entry checked (dtype, shape, a byte range inside the data, after the previous
    tensor's) and read; NaN or infinite values are refused. Returns it and its range's end."""
    dtype = _DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE}: tensor {_short(name)} has dtype {_short(entry.get('dtype'))}; only F32, F16 and BF16 are read"
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or tuple(shape) != expected:
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE}: tensor {_short(name)} has shape {_short(shape)}, expected {list(expected)}"
        )
    offsets = entry.get("data_offsets")
    count = expected[0] * expected[1]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or offsets[0] < previous_end
        or offsets[1] > len(data)
        or offsets[1] - offsets[0] != count * dtype.itemsize
    ):
        raise LoRAAdapterError(
            f"{WEIGHTS_FILE}: tensor {_short(name)} has data_offsets {_short(offsets)} outside the file or overlapping another"
        )
    begin, end = offsets
    tensor = (
        torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).view(expected)
        if count
        else torch.empty(expected, dtype=dtype)
    )
    if not bool(torch.isfinite(tensor).all()):
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: tensor {_short(name)} holds NaN or infinite values")
    return tensor, end


def _short(value: Any) -> str:
    """A value for a one-line message: repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(error: Exception) -> str:
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__
