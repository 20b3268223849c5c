"""Kubernetes resource quantities: strict parsing and the canonical string the API server stores.

The API server never keeps a quantity as it was sent: `cpu: 0.5` comes back as `"500m"`,
`nvidia.com/gpu: 1` as `"1"`, `1024Mi` as `"1Gi"`. The builders emit the canonical form, so the
manifest the operator compares with a live object is exactly what the server returns, and a second
reconcile writes nothing. The rules follow apimachinery's `resource.Quantity.CanonicalizeBytes`:

- the suffix family (decimal SI, binary SI or a decimal exponent) is kept from the input;
- decimal values move every trailing factor of ten into an exponent that is a multiple of 3
  (`1.5` -> `1500m`, `16000000000` -> `16G`, `1200` -> `1200`);
- binary values that are whole and at least 1024 in magnitude take the largest binary suffix
  dividing them exactly (`1024Mi` -> `1Gi`, `1.5Gi` -> `1536Mi`); anything else is shown as decimal
  SI (`0.5Ki` -> `512`, `1.5Ki` -> `1536`);
- precision is nano: values are rounded up to the next multiple of 10^-9.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_PATTERN = re.compile(rf"^({_NUMBER})(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
_BINARY_SUFFIX = {power: suffix for suffix, power in _BINARY.items()} | {0: ""}
_NANO = Decimal("1e-9")

# The regular expression kube-apiserver quotes in its own error message, for familiar wording.
KUBERNETES_PATTERN = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def _parse(text: str) -> tuple[Decimal, str]:
    """(value, format) with format one of "decimal", "binary", "exponent"."""
    match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise QuantityError(
            f"{text!r} is not a quantity (a number with an optional suffix such as 500m, 2, 16Gi or 1e3)"
        )
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only decimals
        raise QuantityError(f"{text!r} is not a quantity") from exc
    if suffix in _BINARY:
        return value * (Decimal(1024) ** _BINARY[suffix]), "binary"
    if suffix in _DECIMAL:
        return value.scaleb(_DECIMAL[suffix]), "decimal"
    return value.scaleb(int(suffix[1:])), "exponent"


def parse_quantity(value: str | int | float) -> Decimal:
    """The numeric value of a quantity (`"500m"` -> 0.5); QuantityError when it is not one."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{value!r} is not a quantity")
        return Decimal(repr(value))
    return _parse(value)[0]


def _round_to_nano(value: Decimal) -> Decimal:
    if value == value.quantize(_NANO, rounding=ROUND_CEILING):
        return value
    return value.quantize(_NANO, rounding=ROUND_CEILING)


def _decimal_mantissa(value: Decimal) -> tuple[int, int]:
    """(mantissa, exponent) with exponent a multiple of 3 and the mantissa as small as exact allows."""
    sign, digits, exponent = value.normalize().as_tuple()
    mantissa = int("".join(map(str, digits)) or "0")
    assert isinstance(exponent, int)
    while exponent % 3 != 0:
        mantissa *= 10
        exponent -= 1
    return (-mantissa if sign else mantissa), exponent


def canonical_quantity(value: str | int | float) -> str:
    """The string kube-apiserver stores for this quantity (`0.5` -> `"500m"`, `1` -> `"1"`)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        amount, fmt = parse_quantity(value), "decimal"
    elif isinstance(value, str):
        amount, fmt = _parse(value)
    else:
        raise QuantityError(f"{value!r} is not a quantity")
    amount = _round_to_nano(amount)
    if amount == 0:
        return "0"
    if fmt == "binary" and (abs(amount) < 1024 or amount != amount.to_integral_value()):
        fmt = "decimal"
    if fmt == "binary":
        whole, power = int(amount), 0
        while whole % 1024 == 0 and power < 6:
            whole //= 1024
            power += 1
        return f"{whole}{_BINARY_SUFFIX[power]}"
    mantissa, exponent = _decimal_mantissa(amount)
    if fmt == "exponent":
        return f"{mantissa}" if exponent == 0 else f"{mantissa}e{exponent}"
    suffix = _DECIMAL_SUFFIX.get(exponent)
    if suffix is None:
        return f"{mantissa}e{exponent}"
    return f"{mantissa}{suffix}"
