"""The `kvasir generate`, `trace`, `simulate` and `render` commands that README.md and docs/*.md
show run as written on a fresh clone, from the repository root. Each fenced shell block is run in
order (a later command may read what an earlier one wrote), in this process, with two changes
only: outputs the docs send to /tmp/ go to a test folder, and the few sizes that would take
minutes are shortened (SHORTER, each one named here, so a doc cannot drift unnoticed)."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvasir.cli import main

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"^kvasir (generate|trace|simulate|render)\b")
OUTPUT_FLAGS = {"--output", "-o", "--plots"}

# Doc text -> what runs here instead: the same commands on less work.
SHORTER = {
    "--duration 3600 --rate 5": "--duration 300 --rate 1",  # 1 h of traffic: minutes for 7 policies
    "--duration 300 --rate 40 --prefix-groups 128": "--duration 10 --rate 5 --prefix-groups 128",  # routing: 14 min
}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    commands: tuple[str, ...]


def doc_blocks() -> list[Block]:
    """Every fenced `sh` block of the docs with a kvasir command, continuation lines joined and
    trailing comments dropped."""
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M):
            joined = re.sub(r"\\\n\s*", " ", match[1])
            commands = tuple(
                line.split("  #")[0].strip() for line in joined.splitlines() if COMMAND.match(line.strip())
            )
            if commands:
                line = text.count("\n", 0, match.start()) + 1
                blocks.append(Block(str(doc.relative_to(REPO)), line, commands))
    return blocks


BLOCKS = doc_blocks()


def test_the_docs_show_each_command() -> None:
    shown = {COMMAND.match(c)[1] for b in BLOCKS for c in b.commands}  # type: ignore[index]
    assert shown == {"generate", "trace", "simulate", "render"}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.doc}:{b.line}" for b in BLOCKS])
def test_documented_commands_run_as_written(block: Block, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)
    for command in block.commands:
        argv = shlex.split(command)[1:]
        for flag, value in itertools.pairwise(argv):
            if flag in OUTPUT_FLAGS:  # the checkout stays clean
                assert value.startswith("/tmp/"), (
                    f"{block.doc}:{block.line}: {flag} {value} writes into the checkout"
                )
        for long, short in SHORTER.items():
            command = command.replace(long, short)
        command = command.replace("/tmp/", f"{tmp_path}/")
        if command.startswith("kvasir generate"):
            command = command.replace("examples/prompts.jsonl", str(_few_tokens(tmp_path)))
        assert main(shlex.split(command)[1:]) == 0, (
            f"{block.doc}:{block.line}: {command}\n{capsys.readouterr().err}"
        )
        capsys.readouterr()


def _few_tokens(tmp_path: Path) -> Path:
    """examples/prompts.jsonl with at most 4 tokens per answer: every line still goes through the
    real model (and its checks), in seconds instead of a minute."""
    lines = [json.loads(line) for line in (REPO / "examples/prompts.jsonl").read_text().splitlines()]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({**line, "max_tokens": min(line["max_tokens"], 4)}) + "\n" for line in lines)
    )
    return path


def test_the_sim_yaml_shown_is_the_example_file() -> None:
    """docs/simulator.md shows examples/sim.yaml, the file its first example runs with."""
    text = (REPO / "docs/simulator.md").read_text()
    shown = re.search(r"^## SIM\.yaml\n.*?^```yaml\n(.*?)^```", text, re.S | re.M)
    assert shown is not None
    example = (REPO / "examples/sim.yaml").read_text()
    assert shown[1] == example.split("\n", 1)[1]  # all but the file's own header comment
