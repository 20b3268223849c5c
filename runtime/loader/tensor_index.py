"""A checkpoint's tensor index checked against its config, before the model is built.

A config (config.json, or a GGUF file's metadata) that lies about the model's shape makes the model
runner allocate what the lie says: a GGUF claiming 1,000,000 layers over tensors for 30 was still
building its layers after two minutes at 1.4 GB and growing, and a vocabulary or hidden size off by
orders of magnitude asks for terabytes. The tensor headers are read without the weights, so the
loader compares the two first: the layer indices the tensors hold must be exactly 0..layers-1, and
every tensor the model reads must have the shape the config gives it (vocabulary, hidden size,
heads x head_dim, the MLP's width). A mismatch is a ModelLoadError naming the tensor, its shape,
the shape the config implies and the fields it comes from.

Names are Hugging Face's (a GGUF file's are mapped first), and shapes are logical: [out, in] for a
linear weight however it is stored (quantized formats pack theirs; `hf_quantized.logical_shapes`).
Tensors the model does not read are left to the model's own check when the weights load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.loader.errors import ModelLoadError

_LAYER = re.compile(r"model\.layers\.(\d+)\.")

# One dimension the config implies: the ModelConfig fields (multiplied) that give it.
_Dim = tuple[str, ...]
_GLOBAL: dict[str, tuple[_Dim, ...]] = {
    "model.embed_tokens.weight": (("vocab_size",), ("hidden_size",)),
    "lm_head.weight": (("vocab_size",), ("hidden_size",)),
    "model.norm.weight": (("hidden_size",),),
}
_Q, _KV = ("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")
_H, _I = ("hidden_size",), ("intermediate_size",)
_PER_LAYER: dict[str, tuple[_Dim, ...]] = {
    "self_attn.q_proj.weight": (_Q, _H),
    "self_attn.k_proj.weight": (_KV, _H),
    "self_attn.v_proj.weight": (_KV, _H),
    "self_attn.o_proj.weight": (_H, _Q),
    "self_attn.q_proj.bias": (_Q,),
    "self_attn.k_proj.bias": (_KV,),
    "self_attn.v_proj.bias": (_KV,),
    "self_attn.o_proj.bias": (_H,),
    "self_attn.q_norm.weight": (("head_dim",),),
    "self_attn.k_norm.weight": (("head_dim",),),
    "mlp.gate_proj.weight": (_I, _H),
    "mlp.up_proj.weight": (_I, _H),
    "mlp.down_proj.weight": (_H, _I),
    "mlp.gate_proj.bias": (_I,),
    "mlp.up_proj.bias": (_I,),
    "mlp.down_proj.bias": (_H,),
    "input_layernorm.weight": (_H,),
    "post_attention_layernorm.weight": (_H,),
}
EMBEDDING = "model.embed_tokens.weight"


def check_tensor_index(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    source: str,
    *,
    field_names: Mapping[str, str] | None = None,
    stored_name: Callable[[str], str] | None = None,
) -> None:
    """ModelLoadError unless `shapes` (Hugging Face name -> logical shape) fit `config`.

    `field_names` spell config fields as the checkpoint does (a GGUF's metadata keys), and
    `stored_name` gives a tensor's name in the file, for the messages."""
    fields = dict(field_names or {})

    def field(name: str) -> str:
        return fields.get(name, name)

    def stored(name: str) -> str:
        return stored_name(name) if stored_name is not None else name

    _check_layers(config, shapes, source, field("num_hidden_layers"), stored)
    if EMBEDDING not in shapes:
        raise ModelLoadError(f"{source}: no token embedding ({stored(EMBEDDING)}) among its tensors")
    names = [EMBEDDING, *(name for name in shapes if name != EMBEDDING)]
    for name in names:
        dims = _expected_dims(name)
        if dims is None:
            continue
        expected = tuple(_product(config, dim) for dim in dims)
        found = tuple(shapes[name])
        if found != expected:
            implied = ", ".join(
                f"{value} ({' x '.join(map(field, dim))})" for value, dim in zip(expected, dims, strict=True)
            )
            raise ModelLoadError(
                f"{source}: tensor {stored(name)} has shape {list(found)}, but the config makes it "
                f"[{implied}]: the config does not describe this checkpoint's weights"
            )


def _check_layers(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    source: str,
    field: str,
    stored: Callable[[str], str],
) -> None:
    present = {int(match[1]) for name in shapes if (match := _LAYER.match(name))}
    claimed = config.num_hidden_layers
    beyond = sorted(index for index in present if index >= claimed)
    if beyond:
        raise ModelLoadError(
            f"{source}: {field} is {claimed:,}, but the checkpoint holds tensors for layer {beyond[-1]} "
            f"({stored(f'model.layers.{beyond[-1]}.')}*)"
        )
    if len(present) != claimed:
        first_missing = next(index for index in range(claimed) if index not in present)
        held = f"{len(present)} layers" if present else "no layers"
        raise ModelLoadError(
            f"{source}: {field} is {claimed:,}, but the checkpoint holds tensors for {held}; none for "
            f"layer {first_missing} ({stored(f'model.layers.{first_missing}.')}*): the config does not "
            "describe this checkpoint's weights"
        )


def _expected_dims(name: str) -> tuple[_Dim, ...] | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER.match(name)
    return _PER_LAYER.get(name[match.end() :]) if match else None


def _product(config: ModelConfig, dim: _Dim) -> int:
    value = 1
    for name in dim:
        value *= int(getattr(config, name))
    return value
