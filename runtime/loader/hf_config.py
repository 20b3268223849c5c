"""Turn a Hugging Face `config.json` dict into a `ModelConfig`, rejecting what we cannot honour."""

from __future__ import annotations

import math
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

    def count(name: str, value: Any) -> int:
        return positive_int(value, f"{source}: {name}")

    hidden_size = count("hidden_size", required("hidden_size"))
    num_heads = count("num_attention_heads", required("num_attention_heads"))
    num_kv_heads = count("num_key_value_heads", hf.get("num_key_value_heads") or num_heads)
    head_dim = count(
        "head_dim" if hf.get("head_dim") else "hidden_size / num_attention_heads",
        hf.get("head_dim") or hidden_size // num_heads,
    )
    if head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim {head_dim} is odd; rotary embeddings need an even one")
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
        vocab_size=count("vocab_size", required("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=count("intermediate_size", required("intermediate_size")),
        num_hidden_layers=count("num_hidden_layers", required("num_hidden_layers")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=finite_float(hf.get("rms_norm_eps", 1e-6), f"{source}: rms_norm_eps", minimum=0.0),
        rope_theta=finite_float(rope_theta, f"{source}: rope_theta"),
        max_position_embeddings=count("max_position_embeddings", hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        rope_scaling=rope_scaling,
        sliding_window=count("sliding_window", sliding_window) if sliding_window else None,
        hidden_act=hidden_act,
        eos_token_ids=_token_ids(hf.get("eos_token_id"), f"{source}: eos_token_id"),
        bos_token_id=_first(_token_ids(hf.get("bos_token_id"), f"{source}: bos_token_id")),
        extra=dict(hf),
    )


def positive_int(value: Any, name: str) -> int:
    """`value` as a count of at least 1 (an integral float such as 2048.0 passes); a ModelLoadError
    naming `name` otherwise, so a zero, negative, fractional or non-numeric field never reaches
    arithmetic (a division by zero heads, a negative size)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{name} is {value!r}: must be a positive integer")
    return value


def finite_float(value: Any, name: str, *, minimum: float | None = None) -> float:
    """`value` as a finite number above 0 (at least `minimum` when given); a ModelLoadError naming
    `name` otherwise."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value < minimum if minimum is not None else value <= 0):
        bound = f"at least {minimum}" if minimum is not None else "above 0"
        raise ModelLoadError(f"{name} is {value!r}: must be a finite number {bound}")
    return float(value)


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
        low = finite_float(scaling["low_freq_factor"], f"{source}: rope_scaling.low_freq_factor")
        high = finite_float(scaling["high_freq_factor"], f"{source}: rope_scaling.high_freq_factor")
        if high <= low:
            raise ModelLoadError(
                f"{source}: rope_scaling.high_freq_factor ({high}) must be above low_freq_factor ({low})"
            )
        positive_int(
            scaling["original_max_position_embeddings"],
            f"{source}: rope_scaling.original_max_position_embeddings",
        )
    finite_float(scaling["factor"], f"{source}: rope_scaling.factor")
    return {**scaling, "rope_type": rope_type}


def _token_id(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{name} is {value!r}: must be a token id (an integer of at least 0)")
    return value


def _first(ids: tuple[int, ...]) -> int | None:
    return ids[0] if ids else None


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(token for token in (_token_id(v, name) for v in values) if token is not None)
