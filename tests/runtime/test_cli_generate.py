"""`kvasir generate`: JSONL in, JSONL out, figures on stderr, clear errors for bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvasir.cli import main
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.generate_input import read_lines
from tests.tiny_checkpoints import VOCAB_SIZE, make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_generate_writes_one_line_per_request(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"prompt": "hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True},
        {"prompt": "abc", "n": 2, "max_tokens": 2, "seed": 3, "ignore_eos": True},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    target = tmp_path / "out.jsonl"
    code = main(
        [
            "generate",
            "--model",
            str(checkpoint),
            "--device",
            "cpu",
            "--input",
            str(source),
            "--output",
            str(target),
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    # One shape whatever n is: a list of choices.
    assert [len(r["choices"]) for r in records] == [1, 1, 1, 2]
    assert [len(r["choices"][0]["token_ids"]) for r in records[:3]] == [5, 3, 4]
    assert all(c["finish_reason"] == "length" for r in records for c in r["choices"])
    assert isinstance(records[0]["choices"][0]["text"], str) and records[0]["prompt_tokens"] > 0
    assert [c["index"] for c in records[3]["choices"]] == [0, 1]
    assert set(records[3]["choices"][0]) == set(records[0]["choices"][0])
    err = capsys.readouterr().err
    assert "output tokens/s" in err


def test_bad_lines_name_the_line_and_field() -> None:
    def errors(text: str) -> list[str]:
        _, found = read_lines(io.BytesIO(text.encode("utf-8", "surrogateescape")))  # \udcff: byte 0xff
        return [str(e) for e in found]

    assert errors('{"prompt": "a"}\n{oops\n') == [
        "line 2: not valid JSON (Expecting property name enclosed in double quotes)"
    ]
    assert errors('{"max_tokens": 3}\n')[0].startswith("line 1: give exactly one")
    assert errors('{"prompt": "a", "temprature": 1}\n') == ["line 1: unknown field(s) temprature"]
    assert errors('{"prompt": "a", "temperature": -1}\n')[0].startswith("line 1: temperature")
    assert errors('{"prompt": "a", "top_p": 1.5}\n')[0].startswith("line 1: top_p")
    assert errors('{"prompt": "a", "max_tokens": {"x": 1}}\n')[0].startswith("line 1: ")
    assert errors('{"prompt": "a"}\n\udcff\n') == ["line 2: not UTF-8 text (invalid start byte)"]
    # Every bad line is found, not just the first.
    assert [e.split(":")[0] for e in errors('{"prompt": 1}\n\n{"prompt": "ok"}\n[]\n')] == [
        "line 1",
        "line 4",
    ]


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["generate", "--device", "cpu", *args])
    return code, capsys.readouterr().err.splitlines()


def test_missing_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n')
    code, err = generate(capsys, "--model", str(tmp_path / "nope"), "--input", str(source))
    assert (code, err) == (2, [f"kvasir generate: {tmp_path / 'nope'}: no such file or directory"])


def test_every_line_is_checked_before_the_model_is_opened(tmp_path: Path, capsys) -> None:
    """Lines with the wrong shape are reported (file and line) even with no model at all."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "ok"}\n{"prompt": "a", "n": 0}\n{"promt": "b"}\n')
    code, err = generate(capsys, "--model", str(tmp_path / "nope"), "--input", str(source))
    assert code == 2
    assert err[0].startswith(f"kvasir generate: {source}: line 2: n: ")
    assert err[1].startswith(f"kvasir generate: {source}: line 3: give exactly one")
    assert err[2] == f"kvasir generate: {source}: nothing generated: fix the lines above"


def test_lines_the_model_cannot_take_are_found_before_its_weights_load(
    checkpoint: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Token ids outside the vocabulary, prompts longer than the context (a multi-megabyte line
    among them, refused without tokenizing), max_tokens past it: all named, nothing generated."""

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LLMEngine, "__init__", no_weights)
    lines = [
        {"prompt": "fine"},
        {"prompt_token_ids": [1, VOCAB_SIZE]},
        {"prompt_token_ids": list(range(65))},
        {"prompt": "x" * 8_000_000},
        {"prompt": "fine", "max_tokens": 64},
        {"messages": [{"role": "user", "content": "fine"}]},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    output = tmp_path / "out.jsonl"
    code, err = generate(
        capsys,
        "--model",
        str(checkpoint),
        "--max-model-len",
        "64",
        "--input",
        str(source),
        "--output",
        str(output),
    )
    assert code == 2
    bad = [line.split(": ", 3)[2:] for line in err if line.startswith(f"kvasir generate: {source}: line")]
    assert [number for number, _ in bad] == ["line 2", "line 3", "line 4", "line 5"]
    assert bad[0][1] == f"prompt: token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"
    assert "maximum context length is 64 tokens" in bad[1][1] and "8000000 characters" in bad[2][1]
    assert bad[3][1].startswith("max_tokens: ")
    assert not output.exists() and list(tmp_path.iterdir()) == [source]  # no partial results file


def test_an_unwritable_output_fails_before_the_model_loads(tmp_path: Path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n')
    target = tmp_path / "missing-dir" / "out.jsonl"
    code, err = generate(
        capsys, "--model", str(tmp_path / "nope"), "--input", str(source), "--output", str(target)
    )
    assert (code, err) == (2, [f"kvasir generate: --output {target}: No such file or directory"])
