"""The quantizers that turn float weights into packed ones at load, by `--quantization` method."""

from __future__ import annotations

from kvasir.runtime.layers.quantization.fp8_linear import online_fp8_weight
from kvasir.runtime.layers.quantization.weights import OnlineQuantizer

# method -> float weight -> QuantizedWeight. A method is listed here once its format module exists.
_ONLINE_QUANTIZERS: dict[str, OnlineQuantizer] = {"fp8": online_fp8_weight}


def online_quantizer(method: str | None) -> OnlineQuantizer:
    """The at-load quantizer of `method`; ValueError naming the ones that exist."""
    quantizer = _ONLINE_QUANTIZERS.get(method or "")
    if quantizer is None:
        known = ", ".join(sorted(_ONLINE_QUANTIZERS)) or "none yet"
        raise ValueError(f"--quantization {method} cannot quantize a float checkpoint at load (can: {known})")
    return quantizer
