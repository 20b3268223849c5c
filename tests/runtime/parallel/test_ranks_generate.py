"""`kvasir generate --tensor-parallel-size 2` writes what one process writes (greedy, n = 2)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvasir.cli import main

LINES = [
    {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2},
]


def _generate(checkpoint: Path, folder: Path, *flags: str) -> list[list[list[int]]]:
    source, target = folder / "in.jsonl", folder / f"out{len(flags)}.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    command = ["generate", "--model", str(checkpoint), "--device", "cpu", "--max-model-len", "128"]
    assert main([*command, "--num-kv-blocks", "32", "-i", str(source), "-o", str(target), *flags]) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    return [[choice["token_ids"] for choice in record["choices"]] for record in records]


def test_two_ranks_write_the_tokens_of_one(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("llama")
    one = _generate(checkpoint, tmp_path)
    assert _generate(checkpoint, tmp_path, "--tensor-parallel-size", "2") == one
    assert [len(choices) for choices in one] == [1, 2]
