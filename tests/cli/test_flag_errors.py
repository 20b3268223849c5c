"""Bad flags and KVASIR_* variables, through `kvasir` itself: one line on stderr naming the flag or
the variable, exit status 2, never a traceback (issue 34, item 10)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvasir.cli import main
from tests.tiny_checkpoints import make_tiny_checkpoint

DEEP_JSON = "[" * 50_000 + "]" * 50_000


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """The exit status (argparse's SystemExit included) and the lines on stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    return code, capsys.readouterr().err.splitlines()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kv-events-config", DEEP_JSON],
            "argument --kv-events-config: kv_events_config is nested too deeply",
        ),
        (
            ["--speculative-config", DEEP_JSON],
            "argument --speculative-config: speculative_config is nested too",
        ),
        (
            ["--kv-events-config", '{"hwm": 100000000000000000000}'],
            "argument --kv-events-config: kv_events_config.hwm must be an integer from 0 to 2147483647",
        ),
        (
            ["--kv-events-config", '{"endpoint": "udp://10.0.0.1:5557"}'],
            "argument --kv-events-config: kv_events_config.endpoint: unknown scheme 'udp://'",
        ),
        (["--kv-cache-memory-fraction", "nan"], "--kv-cache-memory-fraction must be a finite number"),
        (["--drain-timeout", "inf"], "--drain-timeout must be a finite number"),
        (["--num-kv-blocks", "10000000000"], "--num-kv-blocks must be between 1 and 16777216"),
        (["--max-model-len", "abc"], "--max-model-len must be an integer, got 'abc'"),
        (
            ["--lora-dtype", "float8"],
            "--lora-dtype must be one of auto, float32, float16, bfloat16, got 'float8'",
        ),
    ],
    ids=[
        "deep-kv-events",
        "deep-speculative",
        "huge-hwm",
        "unknown-scheme",
        "nan",
        "inf",
        "blocks",
        "int",
        "lora-dtype",
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, err = run(capsys, "serve", *argv)
    assert (code, len(err)) == (2, 1), err
    assert err[0].startswith("kvasir serve: error: ") and message in err[0], err[0]
    assert len(err[0]) < 400


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "KVASIR_ENABLE_PREFIX_CACHING",
            "banana",
            "KVASIR_ENABLE_PREFIX_CACHING must be one of 1/0/true/false/yes/no/on/off, got 'banana'",
        ),
        (
            "KVASIR_CPU_KERNELS",
            "maybe",
            "KVASIR_CPU_KERNELS must be one of 1/0/true/false/yes/no/on/off, got 'maybe'",
        ),
        (
            "KVASIR_CPU_DECODER_STACK",
            "2",
            "KVASIR_CPU_DECODER_STACK must be one of 1/0/true/false/yes/no/on/off, got '2'",
        ),
        (
            "KVASIR_KV_CACHE_MEMORY_FRACTION",
            "nan",
            "KVASIR_KV_CACHE_MEMORY_FRACTION must be a finite number, got nan",
        ),
        ("KVASIR_NUM_KV_BLOCKS", "10000000000", "KVASIR_NUM_KV_BLOCKS must be between 1 and 16777216"),
        (
            "KVASIR_LORA_DTYPE",
            "half",
            "KVASIR_LORA_DTYPE must be one of auto, float32, float16, bfloat16, got 'half'",
        ),
        (
            "KVASIR_KV_EVENTS_CONFIG",
            DEEP_JSON,
            "KVASIR_KV_EVENTS_CONFIG: kv_events_config is nested too deeply",
        ),
    ],
)
def test_bad_environment_variables_are_refused_naming_them(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    checkpoint: Path,
    tmp_path: Path,
    variable: str,
    value: str,
    message: str,
) -> None:
    monkeypatch.setenv(variable, value)
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    for command in (
        ["serve", "--model", str(checkpoint)],
        ["generate", "--model", str(checkpoint), "--device", "cpu", "--input", str(source)],
    ):
        code, err = run(capsys, *command)
        assert (code, len(err)) == (2, 1), err
        assert err[0].startswith(f"kvasir {command[0]}: ") and message in err[0], err[0]


def test_a_value_on_the_command_line_replaces_a_bad_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvasir.runtime.settings import bad_environment

    monkeypatch.setenv("KVASIR_ENABLE_PREFIX_CACHING", "banana")
    monkeypatch.setenv("KVASIR_MAX_MODEL_LEN", "lots")
    from kvasir.cli import build_parser

    args = build_parser().parse_args(["serve", "--no-enable-prefix-caching", "--max-model-len", "64"])
    assert bad_environment(args) is None
    assert (args.enable_prefix_caching, args.max_model_len) == (False, 64)
    # Another command never reads them: a junk variable of `serve` does not stop `render`.
    assert bad_environment(build_parser().parse_args(["render", "-f", "x.yaml"])) is None


def test_the_switches_checked_at_start_up_are_the_kernels_own() -> None:
    from kvasir.kernels import cpu_ops
    from kvasir.runtime.engine_args import ENV_SWITCHES
    from kvasir.runtime.models import cpu_decoder_stack

    assert set(ENV_SWITCHES) == {cpu_ops.DISABLE_ENV, cpu_decoder_stack.DISABLE_ENV}


def test_a_kv_cache_larger_than_the_machine_is_refused_naming_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, checkpoint: Path, tmp_path: Path
) -> None:
    """10**15 bytes (a petabyte) is more than any machine this runs on: refused before allocating."""
    monkeypatch.setenv("KVASIR_KV_CACHE_BYTES", str(10**15))
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    code, err = run(capsys, "generate", "--model", str(checkpoint), "--device", "cpu", "--input", str(source))
    assert code == 2
    assert err[-1].startswith("kvasir generate: --kv-cache-bytes (KVASIR_KV_CACHE_BYTES): a KV cache of ")
    assert "more than this machine's memory" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_a_kv_events_port_in_use_is_one_line_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], checkpoint: Path
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        config = f'{{"endpoint": "tcp://127.0.0.1:{port}", "bind": true}}'
        code, err = run(capsys, "serve", "--model", str(checkpoint), "--kv-events-config", config)
    finally:
        taken.close()
    assert (code, err) == (
        2,
        [f"kvasir serve: --kv-events-config: cannot bind tcp://127.0.0.1:{port}: Address already in use"],
    )


@pytest.mark.parametrize("rate", ["nan", "inf", "-1", "0"])
def test_trace_refuses_a_rate_it_could_never_finish(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, rate: str
) -> None:
    code, err = run(capsys, "trace", "poisson", "--rate", rate, "-o", str(tmp_path / "t.jsonl"))
    assert (code, len(err)) == (2, 1), err
    assert "argument --rate: must be a positive finite number" in err[0]


def test_trace_refuses_more_requests_than_it_writes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err = run(capsys, "trace", "poisson", "--rate", "1e9", "-o", str(tmp_path / "t.jsonl"))
    assert (code, len(err)) == (2, 1) and "at most 10000000 are written" in err[0], err
    assert not (tmp_path / "t.jsonl").exists()
