"""Turn a Hugging Face `config.json` dict into a `ModelConfig`, rejecting what we cannot honour."""

from __future__ import annotations

from typing import Any

from kvasir.runtime.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvasir.runtime.loader.errors import ModelLoadError

_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def model_config_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Validate and convert; every error names `source` and the offending field."""
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{source}: no 'architectures' field; cannot tell which model this is")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def required(name: str) -> Any:
        if name not in hf or hf[name] is None:
            raise ModelLoadError(f"{source}: required field {name!r} is missing")
        return hf[name]

    hidden_size = int(required("hidden_size"))
    num_heads = int(required("num_attention_heads"))
    num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
    head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
    if num_heads % num_kv_heads != 0:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")

    rope_scaling = _rope_scaling(hf, source)
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:  # transformers 5 moved it into rope_parameters
        rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    sliding_window = None
    if architecture == "MistralForCausalLM" or hf.get("use_sliding_window"):
        sliding_window = hf.get("sliding_window")

    return ModelConfig(
        architecture=architecture,
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(required("intermediate_size")),
        num_hidden_layers=int(required("num_hidden_layers")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        rope_scaling=rope_scaling,
        sliding_window=int(sliding_window) if sliding_window else None,
        hidden_act=hidden_act,
        eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        extra=dict(hf),
    )


def _rope_scaling(hf: dict[str, Any], source: str) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling")
    if scaling is None:
        # transformers 5 writes `rope_parameters` (with rope_type "default" when unscaled).
        params = hf.get("rope_parameters")
        if params and params.get("rope_type", "default") != "default":
            scaling = params
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    if "factor" not in scaling:
        raise ModelLoadError(f"{source}: rope_scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        needed = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in needed if key not in scaling]
        if missing:
            raise ModelLoadError(f"{source}: llama3 rope_scaling needs {', '.join(missing)}")
    return {**scaling, "rope_type": rope_type}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
