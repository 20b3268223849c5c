"""Kinds of spec field shaped by Kubernetes: resource quantities, int-or-percent rollout bounds,
lists of object names, command-line arguments, label and annotation maps, and the core/v1
scheduling objects the spec copies into the pod. See kinds.py for what a kind is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvasir.operator.api import affinity, validation
from kvasir.operator.api.kinds import DNS_1123_SUBDOMAIN, Kind, Rule, Schema, whole_number
from kvasir.operator.api.source import SpecError

LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A non-negative quantity as kube-apiserver parses one (suffixes n, u, m, k, M, G, T, P, E, the
# binary Ki..Ei, or a decimal exponent); the sign is left out, since every quantity here is positive.
_QUANTITY_SUFFIX = "(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?"
QUANTITY = f"^([0-9]+([.][0-9]*)?|[.][0-9]+){_QUANTITY_SUFFIX}$"
# The same pattern for a quantity whose digits are all zero (`0`, `0.0Gi`, `.0`, `0e3`).
ZERO_QUANTITY = f"^(0+([.]0*)?|[.]0+){_QUANTITY_SUFFIX}$"


@dataclass(frozen=True)
class Quantity(Kind):
    """A positive resource quantity (`500m`, `16Gi`, `2`), stored canonical. The schema is
    Kubernetes' own for a quantity in a CRD: int-or-string, the string matching the quantity
    pattern, so the API server (and a GitOps dry run) refuses `16GB` as the operator does. A
    fractional number (`cpu: 0.5`) fits neither an integer nor a string: it is refused the same way
    (write `500m` or `"0.5"`); an integral one (`2.0`) is the integer the server stores."""

    def schema(self) -> Schema:
        return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY}

    def rules(self, name: str) -> list[Rule]:
        return [
            {
                "rule": f"type(self) == string ? !self.matches('{ZERO_QUANTITY}') : self > 0",
                "message": f"{name} must be greater than 0",
            }
        ]

    def parse(self, value: Any, path: str) -> str:
        number = whole_number(value)
        if number is None and not isinstance(value, str):
            raise SpecError(
                path,
                f"must be an integer or a quantity string such as '500m', '0.5' or '16Gi', got {value!r}",
            )
        return validation.quantity(value if number is None else number, path, positive=True)


@dataclass(frozen=True)
class IntOrPercent(Kind):
    """A rolling-update bound: a count (1) or a percentage of the replicas (25%)."""

    def schema(self) -> Schema:
        return {"x-kubernetes-int-or-string": True}

    def rules(self, name: str) -> list[Rule]:
        return [
            {
                "rule": "type(self) == int ? self >= 0 : self.matches('^[0-9]+%$')",
                "message": f"{name} must be a count (0, 1, ...) or a percentage such as 25%",
            }
        ]

    def parse(self, value: Any, path: str) -> int | str:
        return validation.int_or_percent(value, path)


def _items(value: Any, path: str, max_items: int, wanted: str) -> list[Any]:
    if not isinstance(value, list):
        raise SpecError(path, f"must be a list of {wanted}")
    if len(value) > max_items:
        raise SpecError(path, f"may hold at most {max_items} items, got {len(value)}")
    return value


class _Container(Kind):
    def crd_default(self, default: Any) -> Any:
        return None  # an empty list or map is left out of the stored object, as Kubernetes does


@dataclass(frozen=True)
class Names(_Container):
    """A list of object names (imagePullSecrets)."""

    max_items: int

    def schema(self) -> Schema:
        item = {"type": "string", "maxLength": 253, "pattern": DNS_1123_SUBDOMAIN}
        return {"type": "array", "maxItems": self.max_items, "items": item}

    def parse(self, value: Any, path: str) -> tuple[str, ...]:
        return validation.name_list(_items(value, path, self.max_items, "names"), path)


@dataclass(frozen=True)
class CommandArgs(_Container):
    """Extra command-line arguments, passed verbatim except the `reserved` flags the operator sets."""

    max_items: int
    max_length: int
    reserved: tuple[str, ...]

    def schema(self) -> Schema:
        return {
            "type": "array",
            "maxItems": self.max_items,
            "items": {"type": "string", "maxLength": self.max_length},
        }

    def crd_default(self, default: Any) -> Any:
        # Unlike the other lists, stored objects have always held `extraArgs: []`; kept so they
        # do not change.
        return list(default)

    def rules(self, name: str) -> list[Rule]:
        refused = " || ".join(f"a == '{flag}' || a.startsWith('{flag}=')" for flag in self.reserved)
        listed = ", ".join(self.reserved[:-1]) + f" or {self.reserved[-1]}"
        return [
            {
                "rule": f"self.all(a, !({refused}))",
                "message": f"{name} must not set {listed}: the operator sets them",
            }
        ]

    def parse(self, value: Any, path: str) -> tuple[str, ...]:
        args = _items(value, path, self.max_items, "strings")
        if not all(isinstance(arg, str) for arg in args):
            raise SpecError(path, "must be a list of strings")
        for arg in args:
            if len(arg) > self.max_length:
                raise SpecError(path, f"an argument may be at most {self.max_length} characters")
            flag = arg.split("=", 1)[0]
            if flag in self.reserved:
                raise SpecError(path, f"{flag} is set by the operator and cannot be overridden")
        return tuple(args)


@dataclass(frozen=True)
class LabelMap(_Container):
    """Label keys to label values (a nodeSelector)."""

    def schema(self) -> Schema:
        value = {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE}
        return {"type": "object", "additionalProperties": value}

    def parse(self, value: Any, path: str) -> dict[str, str]:
        return validation.label_map(value, path)


@dataclass(frozen=True)
class AnnotationMap(_Container):
    def schema(self) -> Schema:
        return {"type": "object", "additionalProperties": {"type": "string"}}

    def parse(self, value: Any, path: str) -> dict[str, str]:
        return validation.annotation_map(value, path)


@dataclass(frozen=True)
class KubeObject(Kind):
    """A core/v1 object copied verbatim into the pod (Affinity). The CRD keeps a small, open subset
    of the Kubernetes schema (`crd`); `shape` is the structure affinity.py checks it against, so a
    typo is InvalidSpec naming the field rather than a 422 on the Deployment."""

    crd: Schema
    shape: affinity.Schema

    def schema(self) -> Schema:
        return dict(self.crd)

    def parse(self, value: Any, path: str) -> dict[str, Any]:
        affinity.check(value, self.shape, path)
        return dict(value)


@dataclass(frozen=True)
class KubeObjectList(_Container):
    """A list of core/v1 objects copied verbatim (tolerations, topology spread constraints)."""

    items: Schema
    shape: affinity.Schema
    max_items: int

    def schema(self) -> Schema:
        return {"type": "array", "maxItems": self.max_items, "items": dict(self.items)}

    def parse(self, value: Any, path: str) -> tuple[dict[str, Any], ...]:
        objects = validation.object_list(_items(value, path, self.max_items, "objects"), path)
        for index, item in enumerate(objects):
            affinity.check(item, self.shape, f"{path}[{index}]")
        return objects
