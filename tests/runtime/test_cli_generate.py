"""`kvasir generate`: JSONL in, JSONL out, figures on stderr, clear errors for bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvasir.cli import main
from kvasir.runtime.cli import InputError, read_requests
from tests.tiny_checkpoints import make_tiny_checkpoint


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
    def parse(text: str):
        return list(read_requests(io.StringIO(text)))

    with pytest.raises(InputError, match="line 2: not valid JSON"):
        parse('{"prompt": "a"}\n{oops\n')
    with pytest.raises(InputError, match="line 1: give exactly one"):
        parse('{"max_tokens": 3}\n')
    with pytest.raises(InputError, match="unknown field"):
        parse('{"prompt": "a", "temprature": 1}\n')
    with pytest.raises(InputError, match="line 1: temperature"):
        parse('{"prompt": "a", "temperature": -1}\n')
    with pytest.raises(InputError, match="top_p"):
        parse('{"prompt": "a", "top_p": 1.5}\n')


def test_missing_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n')
    code = main(["generate", "--model", str(tmp_path / "nope"), "--input", str(source)])
    assert code == 2
    assert "error:" in capsys.readouterr().err
