"""Engine settings are declared once, on EngineConfig's fields: every one is a flag and a KVASIR_*
variable with the field's default, choices and range, and the parsed flags build the same config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvasir.runtime.config import ENGINE_FLAGS, EngineConfig
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args, engine_flag
from kvasir.runtime.spec_decode.config import SpeculativeConfig

NOT_FLAGS = {"model", "hf_token"}  # --model has its own default (embedded); the token is HF_TOKEN only


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(["--model", "/m", *argv]))


def test_every_setting_is_a_flag_with_the_fields_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert {flag.dest for flag in ENGINE_FLAGS} == set(fields) - NOT_FLAGS
    defaults = EngineConfig(model="/m")
    for flag in ENGINE_FLAGS:
        assert flag.default == getattr(defaults, flag.dest), flag.name
    assert parse([]) == EngineConfig(model="/m")


def test_flags_fall_back_to_kvasir_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("KVASIR_LONG_PREFILL_TOKEN_THRESHOLD", "64")
    monkeypatch.setenv("KVASIR_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("KVASIR_ENFORCE_EAGER", "1")
    monkeypatch.setenv("KVASIR_SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 3}')
    config = parse([])
    assert (config.max_num_seqs, config.long_prefill_token_threshold) == (12, 64)
    assert (config.enable_prefix_caching, config.enforce_eager) == (False, True)
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    # The command line wins over the environment.
    assert parse(["--max-num-seqs", "3", "--enable-prefix-caching"]).max_num_seqs == 3
    assert parse(["--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold must be between 0"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy must be one of fcfs, priority"),
        (["--speculative-config", "{not json"], "speculative_config is not valid JSON"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}'],
            "speculative_config.model does not apply to method 'ngram'",
        ),
        (
            ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'],
            "method must be one of",
        ),
    ],
)
def test_bad_values_are_refused_by_the_parser(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_python_api_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be between 1 and 65536, got 0"):
        EngineConfig(model="/m", max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size must be one of 8, 16"):
        EngineConfig(model="/m", block_size=12)


def test_the_operator_reads_the_same_definitions() -> None:
    assert engine_flag("--max-num-seqs").maximum == 65536
    assert engine_flag("--speculative-config").default is None
    assert engine_flag("--model").default == "embedded"


def test_the_scheduler_gets_the_engines_settings(tiny_checkpoint) -> None:
    from kvasir.runtime.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(tiny_checkpoint("llama")),
        device="cpu",
        long_prefill_token_threshold=24,
        scheduling_policy="priority",
        max_num_seqs=5,
    )
    scheduler = LLMEngine(config).scheduler.config
    assert (scheduler.long_prefill_token_threshold, scheduler.policy, scheduler.max_num_seqs) == (
        24,
        "priority",
        5,
    )


@pytest.mark.parametrize("value", ["banana", "", "2", "enabled"])
def test_a_boolean_variable_takes_only_boolean_words(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVASIR_ENABLE_PREFIX_CACHING", value)
    with pytest.raises(
        ValueError, match="KVASIR_ENABLE_PREFIX_CACHING must be one of 1/0/true/false/yes/no/on/off"
    ):
        parse([])
    # What the command line says wins over the variable, junk or not.
    assert parse(["--no-enable-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize(("value", "expected"), [("ON", True), (" no ", False), ("Yes", True), ("0", False)])
def test_boolean_words_in_any_case(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("KVASIR_ENFORCE_EAGER", value)
    assert parse([]).enforce_eager is expected


def test_floats_must_be_finite() -> None:
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction must be a finite number"):
            EngineConfig(model="/m", kv_cache_memory_fraction=value)


def test_process_switches_are_checked_with_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_CPU_KERNELS", "off")
    assert parse([]) == EngineConfig(model="/m")
    monkeypatch.setenv("KVASIR_CPU_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="KVASIR_CPU_KERNELS must be one of"):
        parse([])


def test_the_kernels_read_boolean_variables_with_the_settings_words() -> None:
    """The kernels keep their own copy of the boolean words (they import nothing of the runtime):
    it must stay the settings' table."""
    from kvasir.kernels import cpu_ops
    from kvasir.runtime.settings import BOOL_WORDS

    assert cpu_ops._BOOL_WORDS == BOOL_WORDS
