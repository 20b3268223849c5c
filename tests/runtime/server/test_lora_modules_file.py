"""`--lora-modules-file`: the operator's mounted ConfigMap joins --lora-modules at start-up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvasir.runtime.server.config import add_server_args, server_config_from_args


def _config(*args: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return server_config_from_args(parser.parse_args(list(args)))


def test_the_file_adds_its_adapters(tmp_path: Path) -> None:
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps([{"name": "sql", "path": "/adapters/sql"}, "chat=/adapters/chat"]))
    config = _config("--lora-modules", "x=/adapters/x", "--lora-modules-file", str(path))
    assert [(m.name, m.path) for m in config.lora_modules] == [
        ("x", "/adapters/x"),
        ("sql", "/adapters/sql"),
        ("chat", "/adapters/chat"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{}", "must hold a JSON list"),
        ("[", "not valid JSON"),
        ("[3]", "each item"),
        ('["x=/a", "x=/b"]', "twice"),
    ],
)
def test_a_bad_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "adapters.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        _config("--lora-modules-file", str(path))


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--lora-modules-file"):
        _config("--lora-modules-file", str(tmp_path / "absent.json"))
