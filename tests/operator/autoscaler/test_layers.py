"""The autoscaler's modules import one way only: no cycle, counting the imports made only for
type checking (a cycle hidden behind TYPE_CHECKING still ties the modules into one knot a reader
must hold at once)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvasir.operator.autoscaler as package

PACKAGE = "kvasir.operator.autoscaler"
FOLDER = Path(package.__file__).parent


def imports_of(path: Path) -> set[str]:
    """The autoscaler modules `path` imports, at any depth of its syntax tree (TYPE_CHECKING
    blocks and function bodies included)."""
    names = {p.stem for p in FOLDER.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names if alias.name in names}
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.removeprefix(PACKAGE + ".").split(".")[0])
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {p.stem: imports_of(p) for p in sorted(FOLDER.glob("*.py"))}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path of module names ([] when the graph has none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle_behind_type_checking() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle(edges) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_imports_inside_type_checking_blocks_are_counted(tmp_path: Path) -> None:
    source = tmp_path / "rule.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from kvasir.operator.autoscaler import budget, knee\n"
        "if TYPE_CHECKING:\n"
        "    from kvasir.operator.autoscaler.decide import History\n"
    )
    assert imports_of(source) == {"budget", "knee", "decide"}


def test_the_autoscaler_modules_import_one_way() -> None:
    edges = graph()
    assert {"decide", "slo_rule", "targets", "headroom", "state"} <= set(edges)
    assert cycle(edges) == [], f"import cycle: {' -> '.join(cycle(edges))}"


def test_the_rules_never_import_decide() -> None:
    """decide() composes the rules; a rule that needs one of its types takes it from state.py."""
    edges = graph()
    for rule in ("slo_rule", "pressure", "targets", "headroom", "knee", "learned", "budget", "state"):
        assert "decide" not in edges[rule], rule
