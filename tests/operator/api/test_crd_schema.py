"""The CRD itself: structure, samples, and invalid manifests rejected by its schema and CEL rules
with the message a user would see from `kubectl apply`."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from kvasir.operator import naming
from kvasir.operator.api.source import SpecError
from kvasir.operator.api.spec import parse_spec
from tests.invalid_specs import INVALID, merge


def test_api_coordinates(crd) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{naming.PLURAL}.{naming.GROUP}"
    assert (spec["group"], spec["scope"]) == (naming.GROUP, "Namespaced")
    assert spec["names"]["kind"] == naming.KIND
    assert spec["names"]["shortNames"] == [naming.SHORT_NAME]
    (version,) = spec["versions"]
    assert version["name"] == naming.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Model", "Ready", "Desired", "KV %", "Queue", "Age"} <= set(columns)
    assert columns["Desired"] == ".status.desiredReplicas"


def test_every_spec_field_is_described(crd, kt) -> None:
    """`kubectl explain` shows these; the structural checks are in test_crd_semantics.py."""
    for path, node in kt.crd_semantics.walk(kt.crd_schema(crd)):
        if path.startswith(".spec") and not path.endswith(("[]", "[*]")) and ".tolerations[]." not in path:
            assert node.get("description"), f"{path} has no description"


@pytest.mark.parametrize("name", ["minimal", "autoscaling", "pvc-model", "full"])
def test_samples_are_valid(crd, samples, kt, name) -> None:
    assert kt.validate_cr(crd, samples[name]) == []
    parse_spec(samples[name]["spec"])  # and the operator can honour them


def test_python_defaults_match_the_crd(crd, samples, kt) -> None:
    """The operator's dataclass defaults are the CRD's: parsing a spec with and without the
    API server's defaulting gives the same result."""
    for sample in samples.values():
        defaulted = kt.apply_defaults(kt.crd_schema(crd), copy.deepcopy(sample))
        assert parse_spec(defaulted["spec"]) == parse_spec(sample["spec"])
    minimal = kt.apply_defaults(kt.crd_schema(crd), copy.deepcopy(samples["minimal"]))
    assert minimal["spec"]["runtime"]["blockSize"] == 16
    assert minimal["spec"]["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    # The scale subresource needs spec.replicas to exist: a GET of /scale errors when it is absent.
    assert minimal["spec"]["replicas"] == 1
    assert minimal["spec"]["rollout"] == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize(("case", "patch", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_are_rejected(crd, samples, kt, case, patch, message) -> None:
    manifest = merge(samples["minimal"], patch)
    errors = kt.validate_cr(crd, manifest)
    assert any(error.startswith(message) for error in errors), errors


def test_at_least_fifteen_invalid_cases() -> None:
    assert len(INVALID) >= 15


# A spec with every optional section present, so each numeric field can be varied on its own.
_RANGE_BASE: dict[str, Any] = {
    "model": {"source": "hf://org/name"},
    "runtime": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 4}},
    "autoscaling": {"maxReplicas": 10},
}


def _numeric_fields(kt: Any, crd: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = kt.crd_schema(crd)["properties"]["spec"]
    return [
        (path.lstrip("."), node)
        for path, node in kt.crd_semantics.walk(spec)
        if node.get("type") in ("integer", "number") and "[" not in path
    ]


def _candidates(kt: Any, node: dict[str, Any]) -> set[float]:
    """Values around every bound the field states (OpenAPI or a CEL range), and a few more."""
    bounds = set(kt.crd_semantics.numeric_range(node)) - {None}
    values: set[float] = {-1, 0, 0.5, 1, 2, 10**6}
    for bound in bounds:
        values |= {bound, bound - 0.001, bound + 0.001, math.floor(bound), math.ceil(bound)}
    return values


def _set(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    *parents, leaf = path.split(".")
    target = out
    for key in parents:
        target = target.setdefault(key, {})
    target[leaf] = value
    return out


def _disagreement(crd: dict[str, Any], kt: Any, path: str, value: Any) -> list[str] | None:
    """None when the emulated API server and parse_spec both accept or both refuse `value` at
    `path`; else the API server's errors (empty: it accepted what the parser refused)."""
    spec = _set(_RANGE_BASE, path, value)
    errors = kt.validate_cr(crd, {**kt.llmd("demo"), "spec": spec})
    try:
        parse_spec(kt.apply_defaults(kt.crd_schema(crd), {"spec": spec})["spec"])
        parser_ok = True
    except SpecError:
        parser_ok = False
    return None if (errors == []) == parser_ok else errors


def test_numeric_ranges_hold_for_integer_and_float_input(crd, kt) -> None:
    """Every number field accepts exactly what the operator accepts, whether the value is written
    `1` or `1.0` (kube-openapi would compare an integer with a truncated fractional bound)."""
    checked, disagreements = 0, []
    for path, node in _numeric_fields(kt, crd):
        for value in _candidates(kt, node):
            inputs = [value] if not float(value).is_integer() else [int(value)]
            if node["type"] == "number":
                inputs.append(float(value))
            for written in inputs:
                errors = _disagreement(crd, kt, path, written)
                if errors is not None:
                    disagreements.append((path, written, errors))
                checked += 1
    assert disagreements == []
    assert checked > 200


def _string_fields(kt: Any, crd: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = kt.crd_schema(crd)["properties"]["spec"]
    return [
        (path.lstrip("."), node)
        for path, node in kt.crd_semantics.walk(spec)
        if node.get("type") == "string" and "[" not in path
    ]


def _strings(node: dict[str, Any]) -> list[str]:
    """Empty, badly formed, well formed, one past the length limit, and every allowed value."""
    values = ["", "Not_A Name!", "nvidia.com/gpu", "ok-name", "15s"]
    if "maxLength" in node:
        values += ["a" * node["maxLength"], "a" * (node["maxLength"] + 1)]
    return values + list(node.get("enum", []))


def test_string_constraints_hold_for_the_parser_and_the_api_server(crd, kt) -> None:
    """Every string field (its length, pattern, enum or CEL format, all from the declaration) is
    refused or accepted alike by the emulated API server and by parse_spec."""
    checked, disagreements = 0, []
    for path, node in _string_fields(kt, crd):
        for value in _strings(node):
            errors = _disagreement(crd, kt, path, value)
            if errors is not None:
                disagreements.append((path, value[:20], errors))
            checked += 1
    assert disagreements == []
    assert checked > 100


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("runtime.extraArgs", ["--model=/x"]),
        ("runtime.extraArgs", ["--port"]),
        ("runtime.extraArgs", ["--download-dir", "/d"]),
        ("runtime.extraArgs", ["--max-num-seqs=4", "--portable"]),
        ("runtime.extraArgs", ["a" * 1025]),
        ("runtime.imagePullSecrets", ["registry"]),
        ("runtime.imagePullSecrets", ["Registry"]),
        ("rollout.maxSurge", "25%"),
        ("rollout.maxSurge", "25"),
        ("rollout.maxSurge", -1),
        ("scheduling.nodeSelector", {"pool": "gpu"}),
        ("scheduling.nodeSelector", {"pool": "-gpu"}),
        ("service.annotations", {"a/b": "c"}),
        ("model.tokenSecretRef", {"name": "hf", "key": ""}),
    ],
)
def test_lists_maps_and_int_or_string_hold_for_both(crd, kt, path, value) -> None:
    """The generated rules of list, map and int-or-string kinds agree with the parser."""
    assert _disagreement(crd, kt, path, value) is None
