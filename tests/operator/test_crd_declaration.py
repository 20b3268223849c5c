"""The parts of the CRD generated from a Python declaration (`spec.autoscaling`, from
`kvasir.operator.autoscaler.policy.Policy`) are what the committed files hold: both CRD copies and
the API reference. Adding an autoscaling knob is one field of Policy, then
`python -m kvasir.operator.crd_sync`."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from kvasir.operator import crd_sync
from kvasir.operator.api.source import SpecError
from kvasir.operator.autoscaler.policy import Policy, autoscaling_schema, knobs, parse_policy

REPO = Path(__file__).resolve().parents[2]


def test_committed_crds_and_reference_are_what_the_declaration_generates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    assert crd_sync.main(["--check"]) == 0, capsys.readouterr().out


def test_the_generated_block_is_the_crds_autoscaling_schema(crd) -> None:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["autoscaling"] == autoscaling_schema()
    # Rewriting a file that already holds the block changes nothing.
    text = (REPO / "crds" / crd_sync.CRD_NAME).read_text()
    assert crd_sync.with_generated(text) == text
    assert yaml.safe_load(crd_sync.with_generated(text)) == crd


def test_every_policy_field_but_the_ablations_is_a_crd_knob() -> None:
    declared = {item.name for item in fields(Policy)}
    assert declared - {attr for attr, *_ in knobs()} == {"use_latency_ratio", "use_prediction"}


def test_parser_defaults_are_the_declarations() -> None:
    assert parse_policy({"maxReplicas": 3}) == Policy(max_replicas=3)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "spec.autoscaling.maxReplicas: is required"),
        ({"maxReplicas": 2, "minReplicas": 0}, "spec.autoscaling.minReplicas: must be at least 1"),
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
