"""`--lora-modules` (vLLM's `name=path` and JSON forms, repeatable, also KVASIR_LORA_MODULES),
`--lora-root` and `--lora-unload-timeout`: parsed into ServerConfig, bad values a one-line error
and exit status 2."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvasir.runtime.lora.modules import LoRAModule
from kvasir.runtime.server.config import ServerConfig, add_server_args, server_config_from_args


def parse(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return server_config_from_args(parser.parse_args(argv))


def test_both_forms_repeatable(tmp_path: Path) -> None:
    config = parse(
        [
            "--lora-modules",
            "sql=/a/sql",
            '{"name": "chat", "path": "/a/chat", "base_model_name": "tiny"}',
            "--lora-modules",
            "x=/a/x=y",
            "--lora-root",
            str(tmp_path),
        ]
    )
    assert config.lora_modules == (
        LoRAModule("sql", "/a/sql"),
        LoRAModule("chat", "/a/chat", "tiny"),
        LoRAModule("x", "/a/x=y"),
    )
    assert config.lora_root == str(tmp_path)
    assert parse([]).lora_modules == () and parse([]).lora_root is None


def test_the_environment_holds_them_blank_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_LORA_MODULES", 'a=/p/a \'{"name": "b", "path": "/p/b"}\'')
    assert parse([]).lora_modules == (LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b"))
    assert parse(["--lora-modules", "c=/p/c"]).lora_modules[-1] == LoRAModule("c", "/p/c")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "just-a-name"], "neither name=path nor a JSON object"),
        (["--lora-modules", "=/p"], "non-empty"),
        (["--lora-modules", "a="], "needs a path"),
        (["--lora-modules", "{oops"], "is not valid JSON"),
        (["--lora-modules", '{"name": "a", "path": "/p", "rank": 8}'], "unknown key 'rank'"),
        (["--lora-modules", "a,b=/p"], "comma"),
        (["--lora-modules", "a=hf://org"], "must look like hf://org/name"),
        (["--lora-modules", "a=hf://org/x@v1"], "own field (revision)"),
        (["--lora-modules", '{"name": "a", "path": "/p", "revision": "v1"}'], "applies only to hf:// paths"),
        (["--lora-modules", '{"name": "a", "path": "hf://o/x", "revision": 3}'], "a revision is a branch"),
        (["--lora-unload-timeout", "-1"], "--lora-unload-timeout must be between 0 and 3600"),
    ],
)
def test_bad_values_exit_2_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_config_refuses_duplicates_and_a_missing_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names adapter 'a' twice"):
        parse(["--lora-modules", "a=/p", "a=/q"])
    with pytest.raises(ValueError, match=r"--lora-root .* is not a directory"):
        parse(["--lora-root", str(tmp_path / "missing")])


def test_hub_adapters_with_a_revision_field(tmp_path: Path) -> None:
    # Model sources take their revision from a field (--revision), so an adapter's is one too.
    modules_file = tmp_path / "adapters.json"
    modules_file.write_text('[{"name": "f", "path": "hf://org/f", "revision": "abc123"}, "g=hf://org/g"]')
    config = parse(
        [
            "--lora-modules",
            "sql=hf://org/sql-lora",
            '{"name": "chat", "path": "hf://org/chat-lora", "revision": "v2"}',
            "--lora-modules-file",
            str(modules_file),
        ]
    )
    assert config.lora_modules == (
        LoRAModule("sql", "hf://org/sql-lora"),
        LoRAModule("chat", "hf://org/chat-lora", revision="v2"),
        LoRAModule("f", "hf://org/f", revision="abc123"),
        LoRAModule("g", "hf://org/g"),
    )
