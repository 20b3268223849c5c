"""Checks of values the API server would refuse in a child (422), done while parsing the spec, so a
bad value becomes `Degraded`/`InvalidSpec` naming the LLMDeployment's field, not a failed write."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvasir.operator.api.kinds import whole_number
from kvasir.operator.api.quantity import QuantityError, canonical_quantity, parse_quantity
from kvasir.operator.api.source import SpecError

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_PERCENT = re.compile(r"^[0-9]+%$")


def dns_1035_label(value: Any, field: str) -> str:
    """A Service name: lowercase letters, digits and '-', starting with a letter, at most 63."""
    if not isinstance(value, str) or len(value) > 63 or not _DNS_1035.match(value):
        raise SpecError(
            field,
            f"{value!r} is not a DNS-1035 label (lowercase letters, digits and '-', starting with a "
            "letter and ending with a letter or digit, at most 63 characters)",
        )
    return value


def dns_1123_subdomain(value: Any, field: str) -> str:
    """An object name such as a Secret's, a claim's or a PriorityClass's."""
    if not isinstance(value, str) or not 0 < len(value) <= 253 or not _DNS_1123_SUBDOMAIN.match(value):
        raise SpecError(
            field,
            f"{value!r} is not a valid object name (lowercase letters, digits, '-' and '.', "
            "at most 253 characters)",
        )
    return value


def qualified_name(key: Any, field: str) -> str:
    """A label or annotation key: an optional DNS prefix and '/', then a name of at most 63."""
    if not isinstance(key, str):
        raise SpecError(field, f"key {key!r} must be a string")
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_1123_SUBDOMAIN.match(prefix)):
        raise SpecError(field, f"key {key!r}: the prefix {prefix!r} must be a DNS subdomain")
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        raise SpecError(
            field,
            f"key {key!r}: the name part must be 1-63 characters of letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit",
        )
    return key


def label_value(value: Any, field: str) -> str:
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        raise SpecError(
            field,
            f"{value!r} is not a valid label value (at most 63 characters of letters, digits, '-', '_' "
            "and '.', starting and ending with a letter or digit)",
        )
    return value


def label_map(value: Any, field: str) -> dict[str, str]:
    """A map of label keys to label values (a nodeSelector, a selector)."""
    if not isinstance(value, Mapping):
        raise SpecError(field, "must be an object of label keys to label values")
    return {qualified_name(k, field): label_value(v, f"{field}[{k}]") for k, v in value.items()}


def annotation_map(value: Any, field: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise SpecError(field, "must be an object of annotation keys to strings")
    out = {}
    for key, item in value.items():
        if not isinstance(item, str):
            raise SpecError(f"{field}[{key}]", "an annotation value must be a string")
        out[qualified_name(key, field)] = item
    if sum(len(k) + len(v) for k, v in out.items()) > 256 * 1024:
        raise SpecError(field, "annotations may hold at most 256 KiB in total")
    return out


def quantity(value: Any, field: str, *, positive: bool = False) -> str:
    """A resource quantity (`500m`, `16Gi`, `2`), returned in the API server's canonical form."""
    try:
        amount = parse_quantity(value)
        canonical = canonical_quantity(value)
    except QuantityError as exc:
        raise SpecError(field, str(exc)) from None
    if amount < 0 or (positive and amount == 0):
        raise SpecError(field, f"must be {'greater than' if positive else 'at least'} 0, got {value!r}")
    return canonical


def int_or_percent(value: Any, field: str) -> int | str:
    """A rolling-update bound: a count (`1`) or a percentage of replicas (`25%`)."""
    number = whole_number(value)
    if number is None and not isinstance(value, str):
        raise SpecError(field, f"must be an integer or a percentage such as '25%', got {value!r}")
    if number is not None:
        value = number
        if value < 0:
            raise SpecError(field, f"must be at least 0, got {value}")
        return value
    if not _PERCENT.match(value) or int(value[:-1]) > 100:
        raise SpecError(field, f"must be an integer or a percentage from 0% to 100%, got {value!r}")
    return value


def is_zero(value: int | str) -> bool:
    return value == 0 or value == "0%"


def name_list(value: Any, field: str) -> tuple[str, ...]:
    """A list of object names (imagePullSecrets)."""
    if not isinstance(value, list):
        raise SpecError(field, "must be a list of names")
    return tuple(dns_1123_subdomain(item, f"{field}[{i}]") for i, item in enumerate(value))


def object_list(value: Any, field: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise SpecError(field, "must be a list of objects")
    return tuple(dict(item) for item in value)


def section(parent: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    """`parent[key]` as an object (absent or null: empty, so every default applies); SpecError
    naming `path.key` when it is something else."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key}", "must be an object")
    return value
