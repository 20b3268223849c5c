"""docs/llmdeployment-reference.md is generated from the CRD and must not drift from it."""

from __future__ import annotations

from kvasir.operator.reference import render_reference


def test_reference_matches_the_crd(crd, kt) -> None:
    committed = (kt.REPO / "docs" / "llmdeployment-reference.md").read_text()
    assert committed == render_reference(crd), "regenerate: python -m kvasir.operator.crd_sync"


def test_reference_lists_every_spec_field_and_rule(crd, kt) -> None:
    text = render_reference(crd)
    spec = kt.crd_schema(crd)["properties"]["spec"]["properties"]
    for key in spec:
        assert f"`.spec.{key}`" in text
    assert "rollout.maxSurge and rollout.maxUnavailable cannot both be 0" in text
    assert "| KV % | `.status.kvCacheUsagePercent` |" in text
