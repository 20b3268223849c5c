"""Spec parsing: model sources and the errors the operator reports for specs it cannot honour."""

from __future__ import annotations

import pytest

from kvasir.operator.source import ModelSource, SourceKind, SpecError, parse_model_source
from kvasir.operator.spec import parse_spec


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "hf://meta-llama/Llama-3.1-8B-Instruct",
            ModelSource(SourceKind.HUGGING_FACE, repo_id="meta-llama/Llama-3.1-8B-Instruct"),
        ),
        ("pvc://model-store", ModelSource(SourceKind.PVC, claim="model-store")),
        ("pvc://model-store/qwen/7b/", ModelSource(SourceKind.PVC, claim="model-store", path="qwen/7b")),
        ("/opt/models/smol", ModelSource(SourceKind.LOCAL, path="/opt/models/smol")),
    ],
)
def test_valid_sources(source: str, expected: ModelSource) -> None:
    assert parse_model_source(source) == expected


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("hf://org/na me", "'na me' in 'hf://org/na me' is not a valid Hugging Face name"),
        ("hf://org/a--b", "'a--b' in 'hf://org/a--b' is not a valid Hugging Face name"),
        ("hf://org/name/extra", "'hf://org/name/extra' must look like hf://ORG/NAME"),
        ("pvc://Store/x", "'Store' in 'pvc://Store/x' is not a valid PersistentVolumeClaim name"),
        ("pvc://store/../etc", "path '../etc' must not contain '..' segments"),
        ("/models//llama", "must not contain empty segments"),
        ("s3://bucket/model", "unsupported scheme 's3://'"),
        ("relative/path", "not an absolute path"),
        ("", "a model source is required"),
    ],
)
def test_unusable_sources(source: str, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_model_source(source)
    assert caught.value.field == "spec.model.source"
    assert message in str(caught.value)


def test_served_name_and_desired_replicas() -> None:
    spec = parse_spec({"model": {"source": "pvc://store/qwen2.5-7b"}})
    assert spec.model.served_model_name == "qwen2.5-7b"
    assert spec.desired_replicas == 1
    assert parse_spec({"model": {"source": "/m"}, "replicas": 0}).desired_replicas == 0
    scaled = parse_spec({"model": {"source": "/m"}, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}})
    assert scaled.desired_replicas == 2
    assert scaled.autoscaling is not None and scaled.autoscaling.target_kv_cache_usage == 0.8


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": {"source": "/m"}, "replicas": 1, "autoscaling": {"maxReplicas": 2}}, "mutually exclusive"),
        (
            {"model": {"source": "/m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
            "less than or equal",
        ),
        ({"model": {"source": "/m", "revision": "main"}}, "applies only to hf:// sources"),
        (
            {"model": {"source": "/m"}, "runtime": {"extraArgs": ["--model=/x"]}},
            "--model is set by the operator",
        ),
        ({"model": {"source": "/m"}, "replicas": "two"}, "spec.replicas: must be an integer"),
        ({"model": {"source": "/m", "tokenSecretRef": {}}}, "the Secret's name is required"),
        ({}, "spec.model: is required"),
        (
            {"model": {"source": "/m"}, "runtime": {"kvCacheDtype": "int8"}},
            "spec.runtime.kvCacheDtype: must be one of auto, fp8",
        ),
    ],
)
def test_specs_the_operator_rejects(spec: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        parse_spec(spec)
