"""The CRD passes every check kube-apiserver makes when the CRD is written (structural schema,
each `default` validated alone against its node's schema and CEL rules), so a CRD a real server
would refuse fails here, in CI, where there is no API server. The checker itself is tested on the
mistakes it exists for."""

from __future__ import annotations

import copy
from typing import Any

import pytest


def test_the_crd_would_be_accepted_by_a_real_api_server(crd, kt) -> None:
    assert kt.crd_semantics.crd_errors(crd) == []


def _crd_with(crd: dict[str, Any], kt: Any, path: str, **node: Any) -> dict[str, Any]:
    """A copy of the CRD with the schema node at `path` (dotted, under .spec) updated."""
    broken = copy.deepcopy(crd)
    target = kt.crd_schema(broken)["properties"]["spec"]
    for key in path.split("."):
        target = target["properties"][key]
    target.update(node)
    return broken


def test_a_rule_reading_a_field_its_default_lacks_is_refused(crd, kt) -> None:
    """The mistake a real API server refused in the first release: `resources` defaulted to `{}`
    while its rule read `self.gpus`, and defaults are checked without filling nested defaults.
    The message is kube-apiserver 1.36's, word for word."""
    broken = _crd_with(
        crd,
        kt,
        "resources",
        default={},
        **{"x-kubernetes-validations": [{"rule": "self.gpus <= 1", "message": "one GPU"}]},
    )
    errors = kt.crd_semantics.crd_errors(broken)
    assert (
        'spec.resources.default: Invalid value: "object": no such key: gpus evaluating rule: one GPU'
        in errors
    )


def test_an_unguarded_rule_is_refused_even_without_a_default(crd, kt) -> None:
    """Project rule: a rule must evaluate on the smallest object its node admits (has() guards)."""
    rules = [{"rule": "self.minReplicas <= self.maxReplicas", "message": "min <= max"}]
    broken = _crd_with(crd, kt, "autoscaling", **{"x-kubernetes-validations": rules})
    errors = kt.crd_semantics.crd_errors(broken)
    assert any("spec.autoscaling: rule 'self.minReplicas <= self.maxReplicas'" in e for e in errors), errors


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (
            {"default": {"unknownField": 1}},
            "spec.service.default: must not have unknown fields (unknownField)",
        ),
        ({"default": {"port": 0}}, "spec.service.default.port: Invalid value: 0"),
    ],
)
def test_defaults_are_validated_against_their_schema(crd, kt, node, message) -> None:
    errors = kt.crd_semantics.crd_errors(_crd_with(crd, kt, "service", **node))
    assert any(error.startswith(message) for error in errors), errors


def test_a_fractional_bound_on_a_number_is_refused(crd, kt) -> None:
    broken = _crd_with(crd, kt, "runtime.kvCacheMemoryFraction", minimum=0.01)
    errors = kt.crd_semantics.crd_errors(broken)
    assert any(".spec.runtime.kvCacheMemoryFraction: minimum 0.01 is fractional" in e for e in errors), errors


def test_structural_rules(crd, kt) -> None:
    broken = _crd_with(crd, kt, "runtime.extraArgs", type=None)
    del kt.crd_schema(broken)["properties"]["spec"]["properties"]["runtime"]["properties"]["extraArgs"][
        "type"
    ]
    errors = kt.crd_semantics.crd_errors(broken)
    assert ".spec.runtime.extraArgs: must have a type (a structural schema needs one everywhere)" in errors


def test_integer_input_meets_the_truncated_bound_like_kube_openapi(kt) -> None:
    """kube-openapi compares an integer with int64(bound): the reason fractional bounds are banned."""
    schema = {"type": "object", "properties": {"f": {"type": "number", "minimum": 0.01, "maximum": 0.98}}}
    assert kt.crd_semantics.openapi_errors(schema, {"f": 0}) == []
    assert kt.crd_semantics.openapi_errors(schema, {"f": 1}) == [
        "f: Invalid value: 1: f in body should be less than or equal to 0"
    ]
    assert kt.crd_semantics.openapi_errors(schema, {"f": 0.0}) == [
        "f: Invalid value: 0: f in body should be greater than or equal to 0.01"
    ]
