"""The CRD's `spec` schema: generated from the declaration in spec.py (types, defaults, ranges,
enums, descriptions, the rules a kind implies), with the hand-written CEL rules of cel_rules.py
laid over it. crd_sync.py writes it into the CRD files; tests compare them."""

from __future__ import annotations

from typing import Any

from kvasir.operator.api.cel_rules import RULES
from kvasir.operator.api.declare import ordered
from kvasir.operator.api.kinds import Rule, Schema
from kvasir.operator.api.spec import DESCRIPTION, SPEC


def _at(root: Schema, path: str) -> Schema:
    node = root
    for key in path.split(".")[1:]:
        properties = node.get("properties") or {}
        if key not in properties:
            raise KeyError(f"the CEL overlay names {path}, which the spec does not declare")
        node = properties[key]
    return node


def overlay(root: Schema, rules: dict[str, list[Rule]]) -> Schema:
    """`root` (the `spec` node) with `rules` added to the nodes their paths name."""
    for path, extra in rules.items():
        node = _at(root, path)
        node["x-kubernetes-validations"] = [*node.get("x-kubernetes-validations", []), *extra]
        reordered = ordered(node)
        node.clear()
        node.update(reordered)
    return root


def spec_schema() -> dict[str, Any]:
    """The CRD's `spec` node."""
    root = SPEC.node("")
    root["description"] = DESCRIPTION
    return overlay(ordered(root), RULES)
