"""Structural checks of the pod-scheduling objects the spec copies verbatim into the pod template
(core/v1 Affinity, Toleration, TopologySpreadConstraint). The CRD keeps them open (copying the
whole Kubernetes schema into it would triple its size), so without these checks a typo would only
surface as a 422 on the Deployment; here it becomes `InvalidSpec` naming the LLMDeployment's field.

A schema is a nested description: a dict of field -> schema is an object with those fields (no
others), `[schema]` a list of them, a tuple the allowed strings, and a type the scalar type.
tests/operator/api/test_spec.py checks the errors they report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvasir.operator.api.kinds import whole_number
from kvasir.operator.api.source import SpecError

Schema = Any
REQUIRED = "__required__"

_NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")

_NODE_REQUIREMENT = {REQUIRED: ("key", "operator"), "key": str, "operator": _NODE_OPERATORS, "values": [str]}
_NODE_SELECTOR_TERM = {"matchExpressions": [_NODE_REQUIREMENT], "matchFields": [_NODE_REQUIREMENT]}
_LABEL_SELECTOR = {
    "matchLabels": {str: str},
    "matchExpressions": [
        {REQUIRED: ("key", "operator"), "key": str, "operator": _SELECTOR_OPERATORS, "values": [str]}
    ],
}
_POD_AFFINITY_TERM = {
    REQUIRED: ("topologyKey",),
    "labelSelector": _LABEL_SELECTOR,
    "namespaceSelector": _LABEL_SELECTOR,
    "namespaces": [str],
    "topologyKey": str,
    "matchLabelKeys": [str],
    "mismatchLabelKeys": [str],
}
_POD_AFFINITY = {
    "requiredDuringSchedulingIgnoredDuringExecution": [_POD_AFFINITY_TERM],
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {REQUIRED: ("weight", "podAffinityTerm"), "weight": int, "podAffinityTerm": _POD_AFFINITY_TERM}
    ],
}
AFFINITY: Schema = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            REQUIRED: ("nodeSelectorTerms",),
            "nodeSelectorTerms": [_NODE_SELECTOR_TERM],
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {REQUIRED: ("weight", "preference"), "weight": int, "preference": _NODE_SELECTOR_TERM}
        ],
    },
    "podAffinity": _POD_AFFINITY,
    "podAntiAffinity": _POD_AFFINITY,
}
TOLERATION: Schema = {
    "key": str,
    "operator": ("Exists", "Equal"),
    "value": str,
    "effect": ("", "NoSchedule", "PreferNoSchedule", "NoExecute"),
    "tolerationSeconds": int,
}
TOPOLOGY_SPREAD_CONSTRAINT: Schema = {
    REQUIRED: ("maxSkew", "topologyKey", "whenUnsatisfiable"),
    "maxSkew": int,
    "topologyKey": str,
    "whenUnsatisfiable": ("DoNotSchedule", "ScheduleAnyway"),
    "labelSelector": _LABEL_SELECTOR,
    "minDomains": int,
    "nodeAffinityPolicy": ("Honor", "Ignore"),
    "nodeTaintsPolicy": ("Honor", "Ignore"),
    "matchLabelKeys": [str],
}


# Bounds Kubernetes enforces on these integer fields (in its Go validation, not its OpenAPI schema).
_INT_RANGES = {
    "weight": (1, 100),
    "maxSkew": (1, None),
    "minDomains": (1, None),
    "tolerationSeconds": (None, None),
}


def check(value: Any, schema: Schema, field: str) -> None:
    """Raise SpecError naming the first place where `value` does not fit `schema`."""
    if isinstance(schema, tuple):
        if value not in schema:
            allowed = ", ".join(repr(s) for s in schema)
            raise SpecError(field, f"must be one of {allowed}, got {value!r}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            raise SpecError(field, f"must be a list, got {type(value).__name__}")
        for index, item in enumerate(value):
            check(item, schema[0], f"{field}[{index}]")
    elif isinstance(schema, dict) and str in schema:  # a map of arbitrary string keys
        if not isinstance(value, Mapping):
            raise SpecError(field, f"must be an object, got {type(value).__name__}")
        for key, item in value.items():
            check(item, schema[str], f"{field}[{key}]")
    elif isinstance(schema, dict):
        _check_object(value, schema, field)
    elif schema is int:
        if whole_number(value) is None:
            raise SpecError(field, f"must be an integer, got {value!r}")
    elif not isinstance(value, schema):
        raise SpecError(field, f"must be a {schema.__name__}, got {value!r}")


def _check_object(value: Any, schema: dict[str, Any], field: str) -> None:
    if not isinstance(value, Mapping):
        raise SpecError(field, f"must be an object, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in schema or k == REQUIRED)
    if unknown:
        known = ", ".join(k for k in schema if k != REQUIRED)
        raise SpecError(f"{field}.{unknown[0]}", f"unknown field (known: {known})")
    for key in schema.get(REQUIRED, ()):
        if key not in value:
            raise SpecError(f"{field}.{key}", "is required")
    for key, item in value.items():
        check(item, schema[key], f"{field}.{key}")
        low, high = _INT_RANGES.get(key, (None, None))
        if schema[key] is int and ((low is not None and item < low) or (high is not None and item > high)):
            raise SpecError(f"{field}.{key}", f"must be between {low} and {high or 'any'}, got {item}")


# What the CRD states of these types: a small, open subset (copying Kubernetes' whole schema would
# triple the CRD's size); `check` above holds them to the structures above.
TOLERATION_CRD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"type": "string", "enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer"},
    },
}
AFFINITY_CRD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "nodeAffinity": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "Which nodes the pods may or prefer to run on (core/v1 NodeAffinity).",
        },
        "podAffinity": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "Pods to run near (core/v1 PodAffinity).",
        },
        "podAntiAffinity": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "Pods to keep away from (core/v1 PodAntiAffinity), for example other replicas on "
            "the same node.",
        },
    },
}
TOPOLOGY_SPREAD_CONSTRAINT_CRD: dict[str, Any] = {
    "type": "object",
    "required": ["maxSkew", "topologyKey", "whenUnsatisfiable"],
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "maxSkew": {
            "type": "integer",
            "minimum": 1,
            "description": "The largest allowed difference in pod count between two domains.",
        },
        "topologyKey": {
            "type": "string",
            "description": "The node label whose values are the domains (for example topology.kubernetes.io/zone).",
        },
        "whenUnsatisfiable": {
            "type": "string",
            "enum": ["DoNotSchedule", "ScheduleAnyway"],
            "description": "What the scheduler does when the skew cannot be kept.",
        },
    },
}
