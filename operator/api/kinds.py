"""The kinds of value an LLMDeployment field holds. Each kind knows three things about itself: its
CRD schema, how the operator reads a value of it (SpecError naming the field when it cannot), and
the CEL rules that follow from it. `declare.py` puts kinds together into sections; no kind knows
which field it is used for, so one kind serves every field of its shape.

Here: the plain values (booleans, numbers, strings, a runtime flag's value); Kubernetes-shaped
ones (quantities, names, label maps, core/v1 objects) are in kube_kinds.py."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvasir.operator.api.source import SpecError
from kvasir.runtime.settings import Flag

Schema = dict[str, Any]
Rule = dict[str, str]
# An extra check of a parsed value (a DNS name, a domain-prefixed resource name): returns the value.
Check = Callable[[Any, str], Any]

DNS_1123_SUBDOMAIN = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


_INT64 = 1 << 63


def whole_number(value: Any) -> int | None:
    """`value` as the API server reads a field of type integer: an int, or a float without a
    fraction within int64 (`3.0` and `1e2` are stored, and reach the operator, as 3 and 100; what
    kubectl sends of YAML's `3.0` is `3` already); None for anything else (booleans included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and -_INT64 <= value < _INT64:
        return int(value)
    return None


def _plain(number: float) -> int | float:
    """0.0 and 4.0 are written 0 and 4, as a person writes them in YAML."""
    return int(number) if float(number).is_integer() else number


def _bounds(low: float | None, high: float | None) -> str:
    if high is None:
        return f"at least {low:g}"
    if low is None:
        return f"at most {high:g}"
    return f"between {low:g} and {high:g}"


def _range_message(low: float | None, high: float | None, value: Any) -> str:
    return f"must be {_bounds(low, high)}, got {value}"


class Kind:
    """What every kind answers; `rules` gets the field's name as a CEL message states it
    (`runtime.blockSize`: the path without `spec.`)."""

    def schema(self) -> Schema:
        raise NotImplementedError

    def node(self, name: str) -> Schema:
        """The schema of the field `name`; a section names its own fields after it."""
        return self.schema()

    def parse(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def rules(self, name: str) -> list[Rule]:
        return []

    def crd_default(self, default: Any) -> Any:
        """The default as the CRD writes it (None: the CRD states none)."""
        return default


@dataclass(frozen=True)
class Boolean(Kind):
    def schema(self) -> Schema:
        return {"type": "boolean"}

    def parse(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"must be true or false, got {value!r}")
        return value


@dataclass(frozen=True)
class Integer(Kind):
    minimum: int | None = None
    maximum: int | None = None
    enum: tuple[int, ...] | None = None

    def schema(self) -> Schema:
        node: Schema = {"type": "integer"}
        if self.enum is not None:
            return {**node, "enum": list(self.enum)}
        if self.minimum is not None:
            node["minimum"] = self.minimum
        if self.maximum is not None:
            node["maximum"] = self.maximum
        return node

    def parse(self, value: Any, path: str) -> int:
        number = whole_number(value)
        if number is None:
            raise SpecError(path, f"must be an integer, got {value!r}")
        value = number
        if self.enum is not None and value not in self.enum:
            raise SpecError(path, f"must be one of {', '.join(map(str, self.enum))}, got {value!r}")
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            raise SpecError(path, _range_message(low, high, value))
        return value


@dataclass(frozen=True)
class Number(Kind):
    """A float. A fractional bound becomes a CEL rule rather than `minimum`/`maximum`: kube-openapi
    compares an integer input with the bound truncated, so `minimum: 0.05` would let `0` through."""

    minimum: float | None = None
    maximum: float | None = None

    def _fractional(self) -> bool:
        return any(b is not None and not float(b).is_integer() for b in (self.minimum, self.maximum))

    def schema(self) -> Schema:
        node: Schema = {"type": "number"}
        if not self._fractional():
            if self.minimum is not None:
                node["minimum"] = _plain(self.minimum)
            if self.maximum is not None:
                node["maximum"] = _plain(self.maximum)
        return node

    def rules(self, name: str) -> list[Rule]:
        if not self._fractional():
            return []
        low, high = self.minimum, self.maximum
        parts = ([f"self >= {float(low)!r}"] if low is not None else []) + (
            [f"self <= {float(high)!r}"] if high is not None else []
        )
        return [{"rule": " && ".join(parts), "message": f"{name} must be {_bounds(low, high)}"}]

    def parse(self, value: Any, path: str) -> float:
        # NaN and infinities are not JSON: kubectl cannot send them.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(path, f"must be a number, got {value!r}")
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            raise SpecError(path, _range_message(low, high, value))
        return float(value)


@dataclass(frozen=True)
class String(Kind):
    """A string; `check` (a DNS name, a resource name) replaces the generic length and pattern
    checks with one whose message says what the value must be."""

    enum: tuple[str, ...] | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    means: str | None = None  # what `pattern` asks for, in words ("a duration such as 15s")
    check: Check | None = None

    def schema(self) -> Schema:
        node: Schema = {"type": "string"}
        if self.enum is not None:
            node["enum"] = list(self.enum)
        if self.min_length is not None:
            node["minLength"] = self.min_length
        if self.max_length is not None:
            node["maxLength"] = self.max_length
        if self.pattern is not None:
            node["pattern"] = self.pattern
        return node

    def parse(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, got {value!r}")
        if self.enum is not None and value not in self.enum:
            raise SpecError(path, f"must be one of {', '.join(self.enum)}, got {value!r}")
        if self.check is not None:
            checked: str = self.check(value, path)
            return checked
        if self.min_length is not None and len(value) < self.min_length:
            raise SpecError(path, "must not be empty" if self.min_length == 1 else f"{value!r} is too short")
        if self.max_length is not None and len(value) > self.max_length:
            raise SpecError(path, f"must be at most {self.max_length} characters, got {len(value)}")
        if self.pattern is not None and not re.search(self.pattern, value):
            raise SpecError(
                path, f"must be {self.means or 'a string matching ' + self.pattern}, got {value!r}"
            )
        return value


def flag_kind(flag: Flag, *, integer: bool = False) -> Kind:
    """The kind of a field that becomes a `kvasir serve` flag: the flag's type, choices and range,
    so the operator can never pass a value the runtime refuses. `integer` narrows a float flag
    (seconds) to whole numbers."""
    if flag.type is bool:
        return Boolean()
    if flag.choices is not None:
        if flag.type is int:
            return Integer(enum=tuple(flag.choices))
        return String(enum=tuple(flag.choices))
    if flag.type is int or integer:
        low, high = flag.minimum, flag.maximum
        return Integer(None if low is None else int(low), None if high is None else int(high))
    if flag.type is float:
        return Number(flag.minimum, flag.maximum)
    return String()


def flag_default(flag: Flag, *, integer: bool = False) -> Any:
    return int(flag.default) if integer and flag.default is not None else flag.default


@dataclass(frozen=True)
class Opaque(Kind):
    """A node whose schema and reader are declared elsewhere, by the module that owns the section
    (spec.autoscaling: autoscaler/policy.py). `read` gets the section as a mapping."""

    declared: Callable[[], Schema]
    read: Callable[[Mapping[str, Any]], Any]

    def schema(self) -> Schema:
        return self.declared()

    def parse(self, value: Any, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise SpecError(path, "must be an object")
        return self.read(value)
