"""Which quantization a checkpoint declares, and whether `--quantization` agrees with it.

A GGUF file is `gguf`. A Hugging Face folder declares its format in config.json's
`quantization_config.quant_method` (vLLM reads the same key): `fp8` and `compressed-tensors` (FP8
weights) are `fp8`, `awq` is `awq`, `gptq` is `gptq`. `--quantization` may name the declared
method, or `fp8` for a float checkpoint (quantized at load, as vLLM's dynamic FP8); anything else
is an error naming both. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir.runtime.config import QUANTIZATION_METHODS
from kvasir.runtime.loader.errors import ModelLoadError

# config.json quant_method -> the `--quantization` method that reads it.
HF_QUANT_METHODS = {"fp8": "fp8", "compressed-tensors": "fp8", "awq": "awq", "gptq": "gptq"}
# Methods that can quantize a float checkpoint while it loads.
ONLINE_METHODS = ("fp8",)


@dataclass(frozen=True)
class Quantization:
    """The resolved choice: the method (None: float weights) and whether the loader quantizes
    float weights itself (`--quantization fp8` on a float checkpoint)."""

    method: str | None
    at_load: bool = False


def declared_hf_quantization(hf_config: dict[str, Any], source: str) -> str | None:
    """The method a Hugging Face config.json declares, or None; ModelLoadError for an unknown one."""
    section = hf_config.get("quantization_config")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ModelLoadError(f"{source}: 'quantization_config' must be an object")
    declared = section.get("quant_method")
    if declared not in HF_QUANT_METHODS:
        raise ModelLoadError(
            f"{source}: quantization_config.quant_method {declared!r} is not supported; "
            f"supported: {', '.join(HF_QUANT_METHODS)}"
        )
    return HF_QUANT_METHODS[declared]


def resolve_quantization(requested: str | None, declared: str | None, source: str) -> Quantization:
    """`--quantization` (None: not given) against what the checkpoint declares."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ModelLoadError(
            f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {requested!r}"
        )
    if requested is None or requested == declared:
        return Quantization(declared)
    if declared is None and requested in ONLINE_METHODS:
        return Quantization(requested, at_load=True)
    stored = f"is stored as {declared}" if declared else "holds float weights"
    raise ModelLoadError(
        f"--quantization {requested}: {source} {stored}"
        + ("" if declared else f"; only {', '.join(ONLINE_METHODS)} can quantize a float checkpoint at load")
    )
