"""The CRD's spec schema is generated from one declaration (`kvasir.operator.api.spec`, with
`spec.autoscaling` from `kvasir.operator.autoscaler.policy.Policy` and the CEL overlay of
`kvasir.operator.api.cel_rules`): the committed CRD copies, deploy/kvasir.yaml and the API reference
are what it generates. (That the parser and the generated CRD accept the same values is
test_crd_schema.py's.)"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import yaml

from kvasir.operator import crd_sync
from kvasir.operator.api import crd as generated
from kvasir.operator.api.declare import Section, spec_field
from kvasir.operator.api.kinds import Integer, Number, String
from kvasir.operator.api.source import SpecError
from kvasir.operator.autoscaler.policy import Policy, autoscaling_schema, knobs, parse_policy

REPO = Path(__file__).resolve().parents[3]


def test_committed_crds_and_reference_are_what_the_declaration_generates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    assert crd_sync.main(["--check"]) == 0, capsys.readouterr().out


def test_the_check_fails_when_the_declaration_changes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A field added to the declaration but not written into the files is caught in every file."""
    declared = generated.spec_schema()
    declared["properties"]["runtime"]["properties"]["newKnob"] = {"type": "integer", "description": "new"}
    monkeypatch.setattr(crd_sync, "spec_schema", lambda: declared)
    monkeypatch.chdir(REPO)
    assert crd_sync.main(["--check"]) == 1
    stale = capsys.readouterr().out
    for path in (*crd_sync.CRD_FILES, crd_sync.REFERENCE, crd_sync.DEPLOY):
        assert f"{path}: differs from the declaration" in stale


def test_the_generated_block_is_the_crds_spec_schema(crd) -> None:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec == generated.spec_schema()
    assert spec["properties"]["autoscaling"] == autoscaling_schema()
    # Rewriting a file that already holds the block changes nothing.
    text = (REPO / "crds" / crd_sync.CRD_NAME).read_text()
    assert crd_sync.with_generated(text) == text
    assert yaml.safe_load(crd_sync.with_generated(text)) == crd


def test_an_overlay_rule_on_an_undeclared_field_is_an_error() -> None:
    rule = {"rule": "self > 0", "message": "gone"}
    with pytest.raises(KeyError, match=r"spec.runtime.renamed"):
        generated.overlay(generated.spec_schema(), {"spec.runtime.renamed": [rule]})


def test_every_policy_field_but_the_ablations_is_a_crd_knob() -> None:
    declared = {item.name for item in fields(Policy)}
    assert declared - {attr for attr, *_ in knobs()} == {"use_latency_ratio", "use_prediction"}


def test_parser_defaults_are_the_declarations() -> None:
    assert parse_policy({"maxReplicas": 3}) == Policy(max_replicas=3)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "spec.autoscaling.maxReplicas: is required"),
        ({"maxReplicas": 2, "minReplicas": -1}, "spec.autoscaling.minReplicas: must be between 0 and 10000"),
        (
            {"maxReplicas": 2, "scaleToZero": {"holdSeconds": 0}},
            "spec.autoscaling.scaleToZero.holdSeconds: must be between 1 and 3600",
        ),
        ({"maxReplicas": 2, "minReplicas": 3}, "spec.autoscaling.minReplicas: must be less than or equal"),
        (
            {"maxReplicas": 2, "targets": {"kvCacheUsage": 1.5}},
            "spec.autoscaling.targets.kvCacheUsage: must be between 0.05 and 1, got 1.5",
        ),
        (
            {"maxReplicas": 2, "windows": {"intervalSeconds": 1.5}},
            "spec.autoscaling.windows.intervalSeconds: must be an integer, got 1.5",
        ),
        (
            {"maxReplicas": 2, "behavior": {"tolerance": True}},
            "spec.autoscaling.behavior.tolerance: must be a number, got True",
        ),
        ({"maxReplicas": 2, "behavior": []}, "spec.autoscaling.behavior: must be an object"),
    ],
)
def test_parser_names_the_field(section: dict, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_policy(section)
    assert str(refused.value).startswith(message)


# ---- a new section: what adding spec.routing or spec.model.quantization looks like --------------


@dataclass(frozen=True)
class _Endpoint:
    mode: str = spec_field(String(enum=("kvasir", "gateway")), "Who routes.", default="kvasir")
    weight: float = spec_field(Number(0.05, 1), "Share of the traffic.", default=0.5)


@dataclass(frozen=True)
class _Toy:
    name: str = spec_field(String(max_length=8), "Required: it has no default.")
    replicas: int = spec_field(Integer(1, 4), "A range.", default=1)
    endpoint: _Endpoint = spec_field(Section(_Endpoint), "A nested section.", default=_Endpoint())


def test_a_declared_section_is_its_parser_and_its_schema() -> None:
    toy = Section(_Toy)
    assert toy.parse({"name": "a"}, "spec.toy") == _Toy(name="a")
    assert toy.parse({"name": "a", "endpoint": {"mode": "gateway"}}, "spec.toy").endpoint.mode == "gateway"
    for value, message in [
        ({}, "spec.toy.name: is required"),
        ({"name": "a", "replicas": 5}, "spec.toy.replicas: must be between 1 and 4, got 5"),
        ({"name": "a", "endpoint": {"mode": "x"}}, "spec.toy.endpoint.mode: must be one of kvasir, gateway"),
        ({"name": "a", "endpoint": {"weight": 0}}, "spec.toy.endpoint.weight: must be between 0.05 and 1"),
        ({"name": "a", "endpoint": 3}, "spec.toy.endpoint: must be an object"),
        ({"name": "abcdefghi"}, "spec.toy.name: must be at most 8 characters"),
    ]:
        with pytest.raises(SpecError, match=message):
            toy.parse(value, "spec.toy")
    node = toy.node("toy")
    assert node["required"] == ["name"]
    assert node["properties"]["replicas"] == {
        "type": "integer",
        "default": 1,
        "minimum": 1,
        "maximum": 4,
        "description": "A range.",
    }
    endpoint = node["properties"]["endpoint"]
    assert endpoint["default"] == {} and endpoint["properties"]["mode"]["enum"] == ["kvasir", "gateway"]
    # A fractional bound is a CEL rule (kube-openapi truncates `minimum: 0.05` for an integer input).
    assert endpoint["properties"]["weight"]["x-kubernetes-validations"] == [
        {"rule": "self >= 0.05 && self <= 1.0", "message": "toy.endpoint.weight must be between 0.05 and 1"}
    ]
