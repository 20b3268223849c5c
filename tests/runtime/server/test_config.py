"""`kvasir serve` flags: KVASIR_* environment variables, validation, and the exit code of a failed load."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvasir.runtime.server.config import ServerConfig, add_server_args, server_config_from_args
from tests.runtime.server.harness import TIMEOUT


def parse(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return server_config_from_args(parser.parse_args(argv))


def test_flags_fall_back_to_kvasir_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]) == ServerConfig()
    monkeypatch.setenv("KVASIR_API_KEY", "from-env")
    monkeypatch.setenv("KVASIR_MAX_QUEUE_LEN", "7")
    monkeypatch.setenv("KVASIR_DRAIN_TIMEOUT", "2.5")
    config = parse([])
    assert (config.api_key, config.max_queue_len, config.drain_timeout) == ("from-env", 7, 2.5)
    assert parse(["--api-key", "from-flag"]).api_key == "from-flag"  # the command line wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-queue-len", "-1"], "--max-queue-len must be at least 0, got -1"),
        (["--drain-timeout", "-1"], "--drain-timeout must be between 0 and 3600, got -1.0"),
        (["--port", "70000"], "--port must be between 0 and 65535, got 70000"),
        (["--log-format", "xml"], "--log-format must be one of text, json, got 'xml'"),
    ],
)
def test_bad_flag_values_are_refused_by_the_parser(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_values_are_rejected_by_the_config() -> None:
    with pytest.raises(ValueError):
        parse(["--api-key", ""])


def test_serve_exits_1_when_the_model_cannot_load(tmp_path: Path) -> None:
    # A folder that is there but holds no model: found only when the server loads it.
    command = [
        sys.executable,
        "-m",
        "kvasir.cli",
        "serve",
        "--model",
        str(tmp_path),
        "--port",
        "0",
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert result.returncode == 1, result.stderr
    assert "the model could not be loaded" in result.stderr
