"""How the LLMDeployment spec is declared: a section is a frozen dataclass whose fields carry a
`spec_field(kind, description)`; from that one declaration come the reader (`Section.parse`, with
errors naming the field) and the CRD's schema (`Section.schema`: types, defaults, ranges, enums,
descriptions and the CEL rules that follow from a kind).

    @dataclass(frozen=True)
    class ServiceSpec:
        port: int = spec_field(Integer(1, 65535), "The Service port.", default=8000)

A field's CRD key is its name in camelCase unless `key` says otherwise; a field with no default is
required; a nested section is `Section(ItsDataclass)`, with `check` for rules that span fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from kvasir.operator.api.kinds import Check, Kind, Schema, flag_default, flag_kind
from kvasir.operator.api.source import SpecError
from kvasir.runtime.settings import Flag

# The order keys take in a generated node, so the CRD reads as if a person had written it.
_ORDER = (
    "type",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "maxItems",
    "pattern",
    "description",
    "required",
    "additionalProperties",
    "items",
    "x-kubernetes-validations",
    "properties",
)


@dataclass(frozen=True)
class SpecField:
    kind: Kind
    description: str | None  # None: the kind's own node describes itself
    key: str | None = None
    check: Check | None = None  # a rule of this field beyond its kind's (a message of its own)
    flag: str | None = None  # the `kvasir serve` flag the field becomes, if it is one


def spec_field(
    kind: Kind,
    description: str | None = None,
    *,
    default: Any = MISSING,
    default_factory: Callable[[], Any] | Any = MISSING,
    key: str | None = None,
    check: Check | None = None,
    flag: str | None = None,
) -> Any:
    """A dataclass field that is one field of the LLMDeployment spec."""
    metadata = {"spec": SpecField(kind, description, key, check, flag)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_field(flag: Flag, description: str, *, integer: bool = False) -> Any:
    """A field that becomes the runtime flag `flag`: its kind and default are the flag's."""
    return spec_field(
        flag_kind(flag, integer=integer),
        description,
        default=flag_default(flag, integer=integer),
        flag=flag.name,
    )


def camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


@dataclass(frozen=True)
class Declared:
    """One declared field of a section, as the reader and the schema see it."""

    attr: str
    key: str
    spec: SpecField
    default: Any  # MISSING: required
    default_factory: Any

    @property
    def required(self) -> bool:
        return self.default is MISSING and self.default_factory is MISSING

    def default_value(self) -> Any:
        return self.default_factory() if self.default is MISSING else self.default


def declared_fields(section: type) -> Iterator[Declared]:
    for item in dataclasses.fields(section):
        spec = item.metadata.get("spec")
        if spec is not None:
            key = spec.key or camel_case(item.name)
            yield Declared(item.name, key, spec, item.default, item.default_factory)


def ordered(node: Schema) -> Schema:
    rank = {key: index for index, key in enumerate(_ORDER)}
    return dict(sorted(node.items(), key=lambda item: rank.get(item[0], len(rank))))


@dataclass(frozen=True)
class Section(Kind):
    """An object of the spec, read into the dataclass `of`. `check(parsed, path)` states the rules
    that span its fields (the CEL overlay states the same ones for the API server)."""

    of: type
    check: Callable[[Any, str], None] | None = None

    def parse(self, value: Any, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise SpecError(path, "must be an object")
        values = {}
        for field in declared_fields(self.of):
            where = f"{path}.{field.key}"
            # null is absent: the API server prunes it before defaulting.
            raw = value.get(field.key)
            if raw is None:
                if field.required:
                    raise SpecError(where, "is required")
                continue
            parsed = field.spec.kind.parse(raw, where)
            if field.spec.check is not None:
                parsed = field.spec.check(parsed, where)
            values[field.attr] = parsed
        out = self.of(**values)
        if self.check is not None:
            self.check(out, path)
        return out

    def crd_default(self, default: Any) -> Any:
        # A section that is always there is defaulted whole ({}): the API server then fills its
        # fields' defaults. An optional one (default None) stays absent until written.
        return {}

    def schema(self) -> Schema:
        return self.node("")

    def node(self, name: str) -> Schema:
        """The section's schema; `name` (`runtime`, `model.tokenSecretRef`) names its fields in the
        messages of generated rules."""
        properties = {}
        for field in declared_fields(self.of):
            properties[field.key] = field_schema(field, f"{name}.{field.key}" if name else field.key)
        node: Schema = {"type": "object"}
        required = [field.key for field in declared_fields(self.of) if field.required]
        if required:
            node["required"] = required
        node["properties"] = properties
        return node


def field_schema(field: Declared, name: str) -> Schema:
    """One field's CRD node: its kind's schema, the default, the description, generated rules."""
    kind = field.spec.kind
    node = kind.node(name)
    default = None if field.required else field.default_value()
    written = None if default is None else kind.crd_default(default)
    if written is not None:
        node["default"] = written
    if field.spec.description is not None:
        node["description"] = field.spec.description
    rules = kind.rules(name)
    if rules:
        node["x-kubernetes-validations"] = rules
    return ordered(node)
