"""The operator and the runtime agree on one contract, the runtime's own flag definitions: every
argument list the operator builds parses with `kvasir serve`'s parser into the values the spec
asked for, and every CRD range, enum and default of a runtime setting equals the flag's."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest

from kvasir.operator.api.declare import declared_fields
from kvasir.operator.api.kinds import Boolean, Integer, Number, String
from kvasir.operator.api.spec import ModelSpec, RuntimeSpec, parse_spec
from kvasir.operator.children.deployment import API_KEY_ENV, build_deployment, build_runtime_args
from kvasir.runtime.engine_args import add_engine_args, engine_flag
from kvasir.runtime.server.config import add_server_args, server_flag
from kvasir.runtime.settings import env_name

# CRD field of spec.runtime -> the runtime flag it becomes.
ENGINE_FIELDS = {
    "dtype": "--dtype",
    "maxModelLen": "--max-model-len",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "blockSize": "--block-size",
    "kvCacheMemoryFraction": "--kv-cache-memory-fraction",
    "kvCacheDtype": "--kv-cache-dtype",
}


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvasir serve", exit_on_error=False)
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def _runtime_schema(kt: Any, crd: dict[str, Any]) -> dict[str, Any]:
    return kt.crd_schema(crd)["properties"]["spec"]["properties"]["runtime"]["properties"]


@pytest.mark.parametrize("sample", ["minimal", "autoscaling", "pvc-model", "full"])
def test_every_built_argument_list_parses_with_the_runtimes_parser(samples, sample) -> None:
    spec = parse_spec(samples[sample]["spec"])
    args = build_runtime_args(spec)
    assert args[0] == "serve"
    parsed = _serve_parser().parse_args(args[1:])
    runtime = spec.runtime
    assert parsed.max_num_seqs == runtime.max_num_seqs
    assert parsed.max_num_batched_tokens == runtime.max_num_batched_tokens
    assert parsed.block_size == runtime.block_size
    assert parsed.kv_cache_memory_fraction == runtime.kv_cache_memory_fraction
    assert parsed.kv_cache_dtype == runtime.kv_cache_dtype
    assert parsed.dtype == runtime.dtype
    assert parsed.enable_prefix_caching is runtime.enable_prefix_caching
    assert parsed.speculative_config == runtime.speculative_decoding
    assert parsed.drain_timeout == runtime.drain_timeout_seconds
    assert parsed.served_model_name == spec.model.served_model_name


def test_extreme_values_the_crd_allows_parse_too(crd, kt) -> None:
    schema = _runtime_schema(kt, crd)
    spec: dict[str, Any] = {"model": {"source": "hf://org/name/model-Q4_K_M.gguf"}, "runtime": {}}
    for field in ENGINE_FIELDS:
        node = schema[field]
        low, high = kt.crd_semantics.numeric_range(node)
        spec["runtime"][field] = node["enum"][-1] if "enum" in node else (high if high is not None else low)
    args = build_runtime_args(parse_spec(spec))
    parsed = _serve_parser().parse_args(args[1:])
    assert parsed.model == "hf://org/name/model-Q4_K_M.gguf"
    assert parsed.block_size == schema["blockSize"]["enum"][-1]


def test_crd_ranges_enums_and_defaults_are_the_runtimes(crd, kt) -> None:
    schema = _runtime_schema(kt, crd)
    for field, name in ENGINE_FIELDS.items():
        flag, node = engine_flag(name), schema[field]
        if flag.choices is not None:
            assert set(node["enum"]) == set(flag.choices), field
        else:
            assert kt.crd_semantics.numeric_range(node) == (flag.minimum, flag.maximum), field
        assert node.get("default") == flag.default, field  # None on both sides: the runtime decides
    drain = server_flag("--drain-timeout")
    assert schema["drainTimeoutSeconds"]["default"] == drain.default
    assert (schema["drainTimeoutSeconds"]["minimum"], schema["drainTimeoutSeconds"]["maximum"]) == (
        drain.minimum,
        drain.maximum,
    )


def _another_value(kind: Any, default: Any) -> Any:
    """An allowed value of `kind` other than `default`: the one a forgotten argument would lose."""
    if isinstance(kind, Boolean):
        return not default
    if isinstance(kind, (Integer, String)) and kind.enum is not None:
        return next(choice for choice in kind.enum if choice != default)
    if isinstance(kind, Integer):
        low = kind.minimum if kind.minimum is not None else 0
        return low if low != default else low + 1
    assert isinstance(kind, Number) and kind.minimum is not None and kind.maximum is not None
    return (kind.minimum + kind.maximum) / 2


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return {key: {**base.get(key, {}), **extra.get(key, {})} for key in {*base, *extra}}


def test_every_field_declared_as_a_flag_reaches_the_runtime() -> None:
    """A field declared with flag_field that build_runtime_args forgets fails here: each one, set
    to a value other than its default, arrives in `kvasir serve`'s parsed arguments."""
    flagged = [
        (section, field)
        for section, fields in (
            ("runtime", declared_fields(RuntimeSpec)),
            ("model", declared_fields(ModelSpec)),
        )
        for field in fields
        if field.spec.flag is not None
    ]
    assert len(flagged) >= 10
    assert ("model", "quantization") in {(section, field.key) for section, field in flagged}
    for section, field in flagged:
        value = _another_value(field.spec.kind, field.default)
        raw: dict[str, Any] = _merged({"model": {"source": "/m"}}, {section: {field.key: value}})
        # With an adapter, so that the LoRA flags (--max-loras) are passed too.
        raw["lora"] = [{"name": "a", "source": "/adapters/a", "rank": 8}]
        spec = parse_spec(raw)
        parsed = _serve_parser().parse_args(build_runtime_args(spec)[1:])
        dest = field.spec.flag.lstrip("-").replace("-", "_")
        assert getattr(parsed, dest) == value, field.key


def test_values_outside_the_contract_are_refused_by_both(kt) -> None:
    with pytest.raises(argparse.ArgumentError):
        _serve_parser().parse_args(["--block-size", "12"])
    with pytest.raises(argparse.ArgumentError):
        _serve_parser().parse_args(["--kv-cache-memory-fraction", "0.99"])


def test_the_api_key_variable_is_the_flags() -> None:
    assert env_name("--api-key") == API_KEY_ENV
    deployment = build_deployment(
        "demo", "ns", parse_spec({"model": {"source": "/m"}, "server": {"apiKeySecretRef": {"name": "k"}}})
    )
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "k", "key": "api-key"}}} in env


def test_the_operator_imports_no_torch() -> None:
    """The operator image carries no torch: the shared flag table must not pull it in."""
    code = "import sys, kvasir.operator.api.spec, kvasir.operator.reconcile; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
