"""A corpus of JSON schemas for the constrained-decoding tests: hand-written ones for the shapes a
generator would rarely build (recursion, root scalars, formats, additionalProperties schemas), and
generated ones from a fixed seed.

Each generated schema is an object with at least one required property, and comes with a mutant:
the same schema with that property's type swapped for one its values can never have. Every
complete output of the schema must then fail the mutant, which proves the validator reads what
the schema says. Strings, arrays and numbers are mostly bounded, so a random model finishes.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

from tests.runtime.structured.support import CHECKED_FORMATS

# JSON types as a value has them: an integer is also a number, so they go together.
_TYPE_CLASSES = {"integer": "numeric", "number": "numeric"}
_MUTANT_TYPES = ("boolean", "null", "array", "object", "string", "integer")
_NAMES = ("id", "name", "tags", "value", "kind", "flag", "x", "y", "note", "items")
# Patterns whose Python and Rust (regex crate) meanings agree: anchored, ASCII classes, bounded.
PATTERNS = (
    "^[a-z]{1,6}$",
    "^[A-Z][a-z]{0,5}$",
    "^[0-9]{3}-[0-9]{2}$",
    "^(foo|bar|baz)[0-9]?$",
    "^[a-f0-9]{2,8}$",
    "^x+y*$",
)


@dataclass(frozen=True)
class CorpusSchema:
    name: str
    schema: dict[str, Any]
    mutant: dict[str, Any] | None = None  # a schema no complete output may satisfy


def _classes(types: set[str]) -> set[str]:
    return {_TYPE_CLASSES.get(t, t) for t in types}


class _Generator:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.defs: dict[str, dict[str, Any]] = {}

    def leaf(self) -> tuple[dict[str, Any], set[str]]:
        """A scalar (or scalar-like) schema and the JSON types its values have."""
        rng = self.rng
        kind = rng.choice(
            [
                "string",
                "string",
                "pattern",
                "enum",
                "const",
                "integer",
                "integer",
                "number",
                "boolean",
                "null",
                "format",
                "type_array",
                "any_of",
            ]
        )
        if kind == "string":
            low = rng.randint(0, 3)
            return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}, {"string"}
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(PATTERNS), "minLength": rng.randint(1, 3)}, {
                "string"
            }
        if kind == "enum":
            pool: list[Any] = ["red", "green", "blue", "a b", 0, 7, -3, 2.5, True, False, None, "", "é"]
            values = rng.sample(pool, rng.randint(1, 4))
            return {"enum": values}, {_json_type(v) for v in values}
        if kind == "const":
            value = rng.choice(["fixed", 42, -1.5, True, None, [1, "two"], {"k": "v"}])
            return {"const": value}, {_json_type(value)}
        if kind == "integer":
            low = rng.randint(-50, 50)
            schema: dict[str, Any] = {"type": "integer"}
            if rng.random() < 0.5:
                schema |= {"minimum": low, "maximum": low + rng.randint(0, 200)}
            elif rng.random() < 0.5:
                schema |= {"exclusiveMinimum": low, "exclusiveMaximum": low + rng.randint(2, 200)}
            else:
                schema |= {"minimum": low}
            return schema, {"integer"}
        if kind == "number":
            low = rng.randint(-10, 10)
            if rng.random() < 0.5:
                return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20)}, {"number"}
            return {"type": "number", "exclusiveMinimum": low, "exclusiveMaximum": low + 1}, {"number"}
        if kind in ("boolean", "null"):
            return {"type": kind}, {kind}
        if kind == "format":
            schema = {"type": "string", "format": rng.choice(CHECKED_FORMATS)}
            if schema["format"] == "email":  # any length, and almost any character, otherwise
                schema["maxLength"] = rng.randint(5, 16)
            return schema, {"string"}
        if kind == "type_array":
            choice = rng.choice([["string", "null"], ["integer", "boolean"], ["number", "null", "boolean"]])
            schema = {"type": choice}
            if "string" in choice:
                schema["maxLength"] = rng.randint(0, 6)
            if "integer" in choice or "number" in choice:
                schema |= {"minimum": -5, "maximum": 99}
            return schema, set(choice)
        first, first_types = self.leaf()
        second, second_types = self.leaf()
        return {"anyOf": [first, second]}, first_types | second_types

    def value(self, depth: int) -> tuple[dict[str, Any], set[str]]:
        rng = self.rng
        roll = rng.random()
        if depth > 0 and roll < 0.2:
            return self.array(depth - 1)
        if depth > 0 and roll < 0.35:
            return self.object(depth - 1)
        schema, types = self.leaf()
        if roll > 0.92:  # a definition, referenced
            name = f"d{len(self.defs)}"
            self.defs[name] = schema
            return {"$ref": f"#/$defs/{name}"}, types
        return schema, types

    def array(self, depth: int) -> tuple[dict[str, Any], set[str]]:
        items, _ = self.value(depth)
        low = self.rng.randint(0, 2)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + self.rng.randint(0, 3)}, {
            "array"
        }

    def object(self, depth: int, root: bool = False) -> tuple[dict[str, Any], set[str]]:
        rng = self.rng
        names = rng.sample(_NAMES, rng.randint(1, 4))
        properties = {name: self.value(depth)[0] for name in names}
        required = [name for name in names if rng.random() < 0.6]
        if root and names[0] not in required:
            required.insert(0, names[0])
        schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema, {"object"}

    def corpus_entry(self, index: int) -> CorpusSchema:
        """A root object whose first property is required, and its mutant."""
        self.defs = {}
        rng = self.rng
        first_name = rng.choice(_NAMES)
        first, first_types = self.value(depth=2)
        rest, _ = self.object(depth=1)
        properties = {first_name: first, **{k: v for k, v in rest["properties"].items() if k != first_name}}
        required = [first_name] + [k for k in rest.get("required", []) if k != first_name]
        schema: dict[str, Any] = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
        if self.defs:
            schema["$defs"] = dict(self.defs)
        mutant = copy.deepcopy(schema)
        other = next(t for t in _MUTANT_TYPES if _classes({t}).isdisjoint(_classes(first_types)))
        mutant["properties"][first_name] = {"type": other}
        return CorpusSchema(f"generated-{index}", schema, mutant)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def generated_schemas(count: int, seed: int = 20260) -> list[CorpusSchema]:
    generator = _Generator(seed)
    return [generator.corpus_entry(index) for index in range(count)]


_TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": 0, "maximum": 9},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
_LIST = {
    "$defs": {
        "cell": {
            "type": "object",
            "properties": {
                "head": {"type": "string", "maxLength": 3},
                "tail": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]},
            },
            "required": ["head", "tail"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"list": {"$ref": "#/$defs/cell"}},
    "required": ["list"],
    "additionalProperties": False,
}
_EXPRESSION = {
    "$defs": {
        "expr": {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 99},
                {
                    "type": "object",
                    "properties": {
                        "op": {"enum": ["+", "-", "*"]},
                        "args": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/expr"},
                            "minItems": 2,
                            "maxItems": 2,
                        },
                    },
                    "required": ["op", "args"],
                    "additionalProperties": False,
                },
            ]
        }
    },
    "$ref": "#/$defs/expr",
}


def _person(**extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "format": "email", "maxLength": 24},
            **extra,
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }


HAND_WRITTEN: list[CorpusSchema] = [
    CorpusSchema(name, schema)
    for name, schema in {
        "person": _person(),
        "person-with-tags": _person(
            tags={"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}
        ),
        "tree": _TREE,
        "linked-list": _LIST,
        "expression": _EXPRESSION,
        "root-array": {
            "type": "array",
            "items": {"type": "integer", "minimum": -9, "maximum": 9},
            "minItems": 2,
            "maxItems": 5,
        },
        "root-string": {"type": "string", "minLength": 2, "maxLength": 6},
        "root-pattern": {"type": "string", "pattern": "^[a-z]{1,6}$", "minLength": 4},
        "root-enum": {"enum": ["alpha", "beta", 3, None, False]},
        "root-const": {"const": {"kind": "fixed", "n": [1, 2, 3]}},
        "root-integer": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
        "root-number": {"type": "number", "minimum": 0.5, "maximum": 0.75},
        "root-boolean": {"type": "boolean"},
        "root-null": {"type": "null"},
        "root-type-array": {
            "type": ["integer", "string", "null"],
            "maxLength": 4,
            "minimum": 0,
            "maximum": 5,
        },
        "matrix": {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 1},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
        "tuple": {
            "type": "array",
            "prefixItems": [
                {"type": "string", "maxLength": 3},
                {"type": "integer", "minimum": 0, "maximum": 9},
            ],
            "items": False,
            "minItems": 2,
        },
        "dates": {
            "type": "object",
            "properties": {f: {"type": "string", "format": f} for f in ("date", "time", "date-time")},
            "required": ["date", "time", "date-time"],
            "additionalProperties": False,
        },
        "ids": {
            "type": "object",
            "properties": {f: {"type": "string", "format": f} for f in ("uuid", "ipv4", "ipv6")},
            "required": ["uuid", "ipv4", "ipv6"],
            "additionalProperties": False,
        },
        "email": {"type": "string", "format": "email", "maxLength": 20},
        "additional-properties-schema": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["id"],
            "additionalProperties": {"type": "boolean"},
            "maxProperties": 3,
        },
        "no-required": {
            "type": "object",
            "properties": {
                "a": {"type": "boolean"},
                "b": {"type": "integer", "minimum": 0, "maximum": 3},
                "c": {"enum": ["x", "y"]},
            },
            "additionalProperties": False,
        },
        "one-of-disjoint": {
            "oneOf": [
                {"type": "string", "maxLength": 3},
                {"type": "integer", "minimum": 0, "maximum": 9},
                {"type": "null"},
            ]
        },
        "all-of": {"allOf": [{"type": "integer"}, {"minimum": 10}, {"maximum": 20}]},
        "multiple-of": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
        "nested-required": {
            "type": "object",
            "properties": {
                "outer": {
                    "type": "object",
                    "properties": {
                        "inner": {
                            "type": "object",
                            "properties": {
                                "leaf": {"const": "deep"},
                                "n": {"type": "integer", "minimum": 1, "maximum": 2},
                            },
                            "required": ["leaf"],
                            "additionalProperties": False,
                        }
                    },
                    "required": ["inner"],
                    "additionalProperties": False,
                }
            },
            "required": ["outer"],
            "additionalProperties": False,
        },
        "array-of-objects": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "k": {"enum": ["a", "b", "c"]},
                    "v": {"type": ["number", "null"], "minimum": -1, "maximum": 1},
                },
                "required": ["k", "v"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "empty-array": {"type": "array", "maxItems": 0},
        "string-escapes": {"enum": ['quote"d', "back\\slash", "new\nline", "tab\t"]},
        "unicode": {
            "type": "object",
            "properties": {"ключ": {"const": "значение"}, "名": {"type": "string", "maxLength": 2}},
            "required": ["ключ", "名"],
            "additionalProperties": False,
        },
    }.items()
]
