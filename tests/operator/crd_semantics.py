"""What kube-apiserver checks when a CRD is written, and when a custom resource is: the same rules,
in Python, so CI (which has no API server) refuses a CRD a real server would refuse.

Writing a CRD (apiextensions' ValidateCustomResourceDefinition):
- the schema must be structural: a type everywhere (bar int-or-string and preserve-unknown
  leaves), `items` on arrays, never `properties` beside `additionalProperties`, map-list keys that
  are required or defaulted;
- every `default` is checked on its own, *without filling the defaults nested inside it*: it must
  hold no unknown field, pass the OpenAPI schema of its node, and pass every CEL rule of that node
  and of the nodes below it that the default has values for. A rule reading a field the default
  lacks fails with `no such key` (the mistake that kept the first release from installing).

Writing a custom resource: defaults are filled first, then the OpenAPI schema (kube-openapi's
validator, including its quirk of truncating a fractional `minimum`/`maximum` to an integer when
the value is an integer), then the CEL rules with the schema's types (a `number` is a double even
when written as `1`).

Two checks go beyond the server, as project rules that keep such mistakes out: every CEL rule must
evaluate on the smallest object its schema admits (so it guards optional fields with `has()`), and
no `number` field may carry a fractional bound (the server would truncate it for integer input)."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from kvasir.operator.api.strict_fields import unknown_fields

Schema = dict[str, Any]


def crd_schema(crd: dict[str, Any]) -> Schema:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every node of a schema with its path (`.spec.runtime`, `.spec.runtime.extraArgs[]`)."""
    yield path, schema
    for key, prop in (schema.get("properties") or {}).items():
        yield from walk(prop, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}[*]")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")


def _untyped(schema: Schema) -> bool:
    return bool(
        schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields")
    )


# ---- defaulting and pruning ---------------------------------------------------------------------


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting: absent fields with a `default` get it, recursively (as kube-apiserver)."""
    if isinstance(value, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                value[key] = apply_defaults(prop, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


# ---- the OpenAPI part: kube-openapi's validator and its wording ---------------------------------


def _bound(validator: Any, bound: float, instance: Any, schema: Schema, *, upper: bool) -> Iterator[Any]:
    """kube-openapi compares an integer value with the bound truncated to an integer
    (`int64(0.01)` is 0), so `0` passes `minimum: 0.01`; floats are compared as floats."""
    if not validator.is_type(instance, "number"):
        return
    effective = int(bound) if isinstance(instance, int) and not isinstance(instance, bool) else bound
    if (instance > effective) if upper else (instance < effective):
        kind = "maximum" if upper else "minimum"
        yield jsonschema.ValidationError(
            f"{instance} violates {kind}", validator=kind, validator_value=effective
        )


def _maximum(validator: Any, bound: float, instance: Any, schema: Schema) -> Iterator[Any]:
    yield from _bound(validator, bound, instance, schema, upper=True)


def _minimum(validator: Any, bound: float, instance: Any, schema: Schema) -> Iterator[Any]:
    yield from _bound(validator, bound, instance, schema, upper=False)


KubeOpenAPIValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"maximum": _maximum, "minimum": _minimum}
)


def _strict(schema: Schema) -> Schema:
    """The JSON Schema kubectl's strict field validation amounts to: unknown fields are errors."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "default"}
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    elif isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = _strict(schema["items"])
    return out


def _json_path(parts: Any) -> str:
    """apimachinery's field path: `a.b[0].c`."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "<nil>"


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "null")


def _schema_message(error: Any, prefix: str) -> str:
    """A jsonschema error worded the way kube-apiserver words it."""
    parts = [prefix] if prefix else []
    path = _json_path([*parts, *error.absolute_path])
    value, rule = error.instance, error.validator_value
    if error.validator == "required":
        missing = error.message.split("'")[1]
        return f"{path + '.' if parts or error.absolute_path else ''}{missing}: Required value"
    if error.validator == "additionalProperties":
        extra = sorted(set(value) - set(error.schema.get("properties", {})))
        return ", ".join(f'unknown field "{path}.{field}"' for field in extra)
    if error.validator == "enum":
        supported = ", ".join(json.dumps(str(v)) for v in rule)
        return f"{path}: Unsupported value: {json.dumps(value)}: supported values: {supported}"
    if error.validator in ("minimum", "maximum"):
        relation = "greater than" if error.validator == "minimum" else "less than"
        shown, bound = go_value(value), go_value(rule)
        return f"{path}: Invalid value: {shown}: {path} in body should be {relation} or equal to {bound}"
    if error.validator == "pattern":
        return f"{path}: Invalid value: {json.dumps(value)}: {path} in body should match '{rule}'"
    if error.validator in {"type", "anyOf"}:
        # kube-openapi shows the value's type, not the value, twice; an int-or-string's two
        # types as "integer,string".
        actual = json.dumps(_json_type(value))
        if error.validator == "anyOf":
            rule = ",".join(option["type"] for option in rule)
        return f"{path}: Invalid value: {actual}: {path} in body must be of type {rule}: {actual}"
    if error.validator == "maxLength":
        return f"{path}: Too long: may not be more than {rule} bytes"
    return f"{path}: Invalid value: {error.message}"


_VALIDATORS: dict[int, tuple[Schema, Any]] = {}


def openapi_errors(schema: Schema, value: Any, prefix: str = "") -> list[str]:
    cached = _VALIDATORS.get(id(schema))
    if cached is None or cached[0] is not schema:  # the schema is kept, so its id stays its own
        cached = _VALIDATORS[id(schema)] = (schema, KubeOpenAPIValidator(_strict(schema)))
    validator = cached[1]
    ordered = sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [_schema_message(error, prefix) for error in ordered]


# ---- the CEL part -------------------------------------------------------------------------------


def to_cel(schema: Schema, value: Any) -> Any:
    """A JSON value as kube-apiserver hands it to CEL: typed by the schema, so a `number` written
    as `1` is the double 1.0 and an int-or-string keeps its JSON type."""
    kind = schema.get("type")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        converted = {}
        for key, item in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else {})
            converted[celtypes.StringType(key)] = to_cel(sub, item)
        return celtypes.MapType(converted)
    if isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items") or {}, item) for item in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, (int, float)):
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    return celpy.json_to_cel(value)


_PROGRAMS: dict[str, Any] = {}


def _sum(values: Any) -> Any:
    """Kubernetes' CEL list library's `sum()` (cel-python has no such macro)."""
    items = list(values)
    total = items[0] if items else celtypes.IntType(0)
    for item in items[1:]:
        total = total + item
    return total


# The functions of Kubernetes' CEL libraries that the CRD's rules use, beyond standard CEL.
_KUBERNETES_FUNCTIONS = {"sum": _sum}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        env = celpy.Environment()
        _PROGRAMS[rule] = env.program(env.compile(rule), functions=_KUBERNETES_FUNCTIONS)
    return _PROGRAMS[rule]


def go_value(value: Any) -> str:
    """A value as apimachinery's field errors print it (`%v` for numbers, `%q` for strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


@dataclass(frozen=True)
class RuleFailure:
    """One CEL rule that did not hold (or could not be evaluated), worded as kube-apiserver does."""

    path: str
    rule: str
    detail: str  # the rule's message, or the evaluation error
    shown: str  # the value after "Invalid value: ", or "" where none is shown
    unevaluable: bool = False  # the rule raised (e.g. `no such key`) instead of answering false

    def __str__(self) -> str:
        value = f"{self.shown}: " if self.shown else ""
        return f"{self.path}: Invalid value: {value}{self.detail}"


def _evaluation_error(exc: Exception) -> str:
    """cel-python's wording of an evaluation error, in cel-go's where they differ (`no such key`)."""
    text = str(exc)
    found = re.search(r"no such member in mapping: '([^']+)'", text)
    return f"no such key: {found[1]}" if found else text


def evaluate_rule(rule: dict[str, Any], schema: Schema, value: Any, path: str) -> RuleFailure | None:
    """One rule on one value; None when it holds."""
    kind = json.dumps(schema.get("type", ""))
    try:
        result = _program(rule["rule"]).evaluate({"self": to_cel(schema, value)})
    except celpy.CELEvalError as exc:
        result = exc
    if isinstance(result, celpy.CELEvalError):
        # cel-go names the rule by its message when it has one (apiextensions' ruleErrorString).
        detail = f"{_evaluation_error(result)} evaluating rule: {rule.get('message') or rule['rule']}"
        return RuleFailure(path, rule["rule"], detail, kind, unevaluable=True)
    if bool(result) is True:
        return None
    # A rule that answers false on an object or array shows no value (kube-apiserver 1.36); on a
    # scalar it shows the value. (A rule that cannot be evaluated shows the type, above.)
    shown = "" if schema.get("type") in ("object", "array") else go_value(value)
    return RuleFailure(path, rule["rule"], rule.get("message") or "failed rule", shown)


def cel_failures(schema: Schema, value: Any, path: str = "<nil>") -> list[RuleFailure]:
    """Every CEL rule of `schema` and of its sub-schemas present in `value`, evaluated as is."""

    def child(key: Any) -> str:
        return str(key) if path == "<nil>" else f"{path}.{key}"

    failures: list[RuleFailure] = []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                failures += cel_failures(sub, item, child(key))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            failures += cel_failures(schema["items"], item, f"{path}[{index}]")
    for rule in schema.get("x-kubernetes-validations") or []:
        failure = evaluate_rule(rule, schema, value, path)
        if failure is not None:
            failures.append(failure)
    return failures


# ---- a custom resource, as the API server validates it ------------------------------------------


def validate_cr(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Every error kube-apiserver (with kubectl's strict field validation) would report for `obj`."""
    schema = crd_schema(crd)
    obj = apply_defaults(schema, copy.deepcopy(obj))
    errors = openapi_errors(schema, obj)
    return errors + [str(failure) for failure in cel_failures(schema, obj)]


# ---- the CRD itself, as the API server validates it when it is written --------------------------


def structural_errors(schema: Schema) -> list[str]:
    """Violations of the structural-schema rules (and of this project's rule on fractional bounds)."""
    errors = []
    for path, node in walk(schema):
        where = path or "<root>"
        typed = "type" in node
        if not typed and not _untyped(node):
            errors.append(f"{where}: must have a type (a structural schema needs one everywhere)")
        if node.get("x-kubernetes-int-or-string") and typed:
            errors.append(f"{where}: x-kubernetes-int-or-string must not have a type")
        if "properties" in node and "additionalProperties" in node:
            errors.append(f"{where}: properties and additionalProperties are mutually exclusive")
        if node.get("type") == "array" and "items" not in node:
            errors.append(f"{where}: an array must declare its items")
        if node.get("x-kubernetes-validations") and not typed and not node.get("x-kubernetes-int-or-string"):
            errors.append(f"{where}: CEL rules need a typed schema (an untyped field is invisible to CEL)")
        if node.get("x-kubernetes-list-type") == "map":
            item = node.get("items") or {}
            for key in node.get("x-kubernetes-list-map-keys") or []:
                prop = (item.get("properties") or {}).get(key)
                if prop is None or (key not in (item.get("required") or []) and "default" not in prop):
                    errors.append(f"{where}: list-map key {key!r} must be a required or defaulted property")
        if node.get("type") == "number":
            for bound in ("minimum", "maximum"):
                if bound in node and not float(node[bound]).is_integer():
                    errors.append(
                        f"{where}: {bound} {node[bound]} is fractional; kube-openapi truncates it to "
                        f"{math.trunc(node[bound])} for integer input, so state the range as a CEL rule"
                    )
        for value in node.get("enum") or []:
            if openapi_errors({k: v for k, v in node.items() if k != "enum"}, value):
                errors.append(f"{where}: enum value {value!r} does not match the field's own schema")
    return errors


def default_errors(schema: Schema) -> list[str]:
    """What the API server says of each `default` when the CRD is written: the default alone
    (nested defaults not filled in) must be pruned, pass its node's schema and its CEL rules."""
    errors = []
    for path, node in walk(schema):
        if "default" not in node:
            continue
        where = f"{path.lstrip('.') or '<root>'}.default"
        default = node["default"]
        for field in unknown_fields(default, node):
            errors.append(f"{where}: must not have unknown fields ({field})")
        problems = openapi_errors(node, default, where)
        errors += problems
        if not problems:
            errors += [str(failure) for failure in cel_failures(node, default, where)]
    return errors


def _smallest(schema: Schema) -> Any:
    """The smallest value a schema admits: an object with only its required fields, each smallest;
    enums and bounds respected; no defaults filled in."""
    if "default" in schema and not isinstance(schema["default"], dict):
        return copy.deepcopy(schema["default"])
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties") or {}
        return {key: _smallest(props[key]) for key in schema.get("required") or [] if key in props}
    if kind == "array":
        return []
    if kind in ("integer", "number"):
        low = schema.get("minimum", 1)
        return int(low) if kind == "integer" else float(low)
    if kind == "boolean":
        return False
    if schema.get("x-kubernetes-int-or-string"):
        return 1
    return _sample_string(schema)


def _sample_string(schema: Schema) -> str:
    hints = {"^/": "/models/m", "hf://": "hf://org/name", "pvc://": "pvc://claim"}
    for rule in schema.get("x-kubernetes-validations") or []:
        for hint, sample in hints.items():
            if hint in rule["rule"]:
                return sample
    return "x" * max(1, int(schema.get("minLength", 1)))


def unguarded_rule_errors(schema: Schema) -> list[str]:
    """Rules that cannot be evaluated on the smallest object their node admits: they read an
    optional field without `has()`, and break as soon as a parent gets `default: {}`."""
    errors = []
    for path, node in walk(schema):
        rules = node.get("x-kubernetes-validations") or []
        if not rules or not node.get("properties"):
            continue
        smallest = _smallest(node)
        if not path:  # the resource root: the API server always has these
            smallest.update(apiVersion="v", kind="K", metadata={"name": "a"})
        for rule in rules:
            failure = evaluate_rule(rule, node, smallest, path.lstrip(".") or "<root>")
            if failure is not None and failure.unevaluable:
                errors.append(f"{failure.path}: rule {rule['rule']!r} fails on {smallest}: {failure.detail}")
    return errors


def crd_errors(crd: dict[str, Any]) -> list[str]:
    """Everything a real API server would refuse in this CRD, plus the project's two rules."""
    schema = crd_schema(crd)
    errors = structural_errors(schema) + default_errors(schema) + unguarded_rule_errors(schema)
    for path, node in walk(schema):
        for rule in node.get("x-kubernetes-validations") or []:
            try:
                _program(rule["rule"])
            except celpy.CELParseError as exc:
                errors.append(f"{path}: rule {rule['rule']!r} does not compile: {exc}")
            if not rule.get("message"):
                errors.append(f"{path}: rule {rule['rule']!r} has no message")
    return errors


def numeric_range(node: Schema) -> tuple[float | None, float | None]:
    """(lowest, highest) a number field allows: its OpenAPI bounds, or the CEL range rule that
    replaces fractional ones (`self >= 0.01 && self <= 0.98`)."""
    low, high = node.get("minimum"), node.get("maximum")
    for rule in node.get("x-kubernetes-validations") or []:
        if (found := re.search(r"self >= (-?[0-9.]+)", rule["rule"])) is not None:
            low = float(found[1])
        if (found := re.search(r"self <=? (-?[0-9.]+)", rule["rule"])) is not None:
            high = float(found[1])
    return low, high
