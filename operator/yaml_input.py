"""YAML and JSON files that users hand to the CLI (`kvasir render -f`, SIM.yaml), read so that every
problem is one line naming where it is: bad UTF-8, a syntax error, a duplicate key, a tag other
than plain data (`!!python/...` is refused, never run), and nesting or alias expansion too large
to walk (a "billion laughs" file would otherwise exhaust memory in whatever reads it next)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

MAX_DEPTH = 100  # an LLMDeployment with a full affinity block is about 12 deep
MAX_NODES = 100_000  # values after aliases are expanded; a large manifest has a few thousand
# The largest file read, checked before parsing: YAML parses at about 1 MB/s in Python, with some
# eight times the text in memory (a 100 MB file took 90 s and 761 MB). The API server takes
# objects of at most 1.5 MiB (etcd's request limit); a file of many such objects fits in this.
MAX_INPUT_BYTES = 8 << 20


class InputError(ValueError):
    """A file that cannot be read as data; `line` (1-based) when it is known."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None) -> None:
        where = "" if line is None else f"line {line}" + ("" if column is None else f", column {column}")
        super().__init__(f"{where}: {message}" if where else message)
        self.message = message
        self.line = line


@dataclass(frozen=True)
class Document:
    """One parsed document, and its YAML node (None for JSON) to find the line of a field."""

    value: Any
    node: yaml.Node | None = None

    @property
    def line(self) -> int | None:
        return None if self.node is None else self.node.start_mark.line + 1

    def line_of(self, path: str) -> int | None:
        """The line of the field at `path` (`spec.scheduling.tolerations[0].key`), or of the
        deepest part of it that exists; None if not even its first part does."""
        node, found = self.node, None
        for part in re.findall(r"\[(\d+)\]|([^.\[\]]+)", path):
            entry = None if node is None else _entry(node, int(part[0]) if part[0] else part[1])
            if entry is None:
                break
            key, node = entry
            found = key.start_mark.line + 1
        return found

    def child(self, *path: str | int) -> Document:
        """The document at `path` inside this one (a List's items)."""
        value, node = self.value, self.node
        for part in path:
            value = value[part]
            entry = None if node is None else _entry(node, part)
            node = None if entry is None else entry[1]
        return Document(value, node)


def _entry(node: yaml.Node, part: str | int) -> tuple[yaml.Node, yaml.Node] | None:
    """(where it is written, its value) of a mapping's key or a sequence's item."""
    if isinstance(node, yaml.MappingNode) and isinstance(part, str):
        return next(
            ((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None
        )
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        item: yaml.Node = node.value[part]
        return item, item
    return None


def read_input(source: str | Path | BinaryIO) -> bytes:
    """A file's bytes (or a stream's, such as stdin's), InputError when there are more than
    MAX_INPUT_BYTES: checked before the file is read whole, never after parsing it."""
    if isinstance(source, (str, Path)):
        try:
            with open(source, "rb") as handle:
                return read_input(handle)
        except OSError as exc:
            raise InputError(exc.strerror or str(exc)) from None
    data = source.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise InputError(f"larger than {MAX_INPUT_BYTES >> 20} MiB: too large to read")
    return data


def decode(data: bytes) -> str:
    """UTF-8 text (a byte-order mark is allowed), or InputError naming the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})", line
        ) from None


def load_documents(text: str, *, json_file: bool = False) -> list[Document]:
    """Every document of a (multi-document) YAML text, or the one object of a JSON text."""
    if json_file:
        try:
            value = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON ({exc.msg})", exc.lineno, exc.colno) from None
        except RecursionError:
            raise InputError(f"nested more than {MAX_DEPTH} levels deep") from None
        check_shape(value)
        return [Document(value)]
    loader = _Loader(text)
    documents = []
    try:
        while loader.check_node():
            node = loader.get_node()
            documents.append(Document(loader.construct_document(node), node))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = exc.problem or exc.context or "not valid YAML"
        if exc.context and exc.problem and exc.context_mark is not None:
            message += f" ({exc.context} on line {exc.context_mark.line + 1})"
        raise InputError(message, *((mark.line + 1, mark.column + 1) if mark else ())) from None
    except yaml.YAMLError as exc:  # a ReaderError: a control character, no line of its own
        raise InputError(" ".join(str(exc).split())) from None
    finally:
        loader.dispose()
    return documents


def check_shape(value: Any) -> None:
    """InputError for JSON data nested deeper than MAX_DEPTH or of more than MAX_NODES values
    (the bounds YAML gets while it is composed), walked without recursion."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH:
            raise InputError(f"nested more than {MAX_DEPTH} levels deep")
        if nodes > MAX_NODES:
            raise InputError(f"holds more than {MAX_NODES} values")
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)


def _no_duplicates(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InputError(f'duplicate key "{key}"')
        seen[key] = value
    return seen


class _Loader(yaml.SafeLoader):
    """SafeLoader with the limits above, duplicate keys refused, and dates left as strings (as
    Kubernetes reads YAML: `2024-01-01` is a string there, not a date)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._measured: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, depth) once aliases expand

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._measured:
                raise ComposerError(None, None, "an alias refers to a node that contains it", mark)
            return node
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is not None:
            self._measure(node)
        return node

    def _measure(self, node: yaml.Node) -> None:
        """Nodes and depth of `node` with every alias expanded, from its children's (known already:
        an alias can only name a node composed before it)."""
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [item for pair in node.value for item in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        measures = [self._measured[id(child)] for child in children]
        size = 1 + sum(n for n, _ in measures)
        depth = 1 + max((d for _, d in measures), default=0)
        if size > MAX_NODES:
            raise ComposerError(None, None, f"expands to more than {MAX_NODES} values", node.start_mark)
        if depth > MAX_DEPTH:
            raise ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep once aliases expand", node.start_mark
            )
        self._measured[id(node)] = (size, depth)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise ConstructorError(None, None, f'duplicate key "{key.value}"', key.start_mark)
                seen.add(key.value)
        return super().construct_mapping(node, deep=deep)

    def construct_undefined(self, node: yaml.Node) -> Any:
        tag = str(node.tag).replace("tag:yaml.org,2002:", "!!")
        raise ConstructorError(
            None, None, f"unsupported tag {tag}: only plain YAML data is read", node.start_mark
        )


_Loader.add_constructor(None, _Loader.construct_undefined)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# Floats as Kubernetes' YAML reader (go-yaml) has them: `1e2` and `1.5e3` too, which YAML 1.1 (and
# so PyYAML) reads as strings; kubectl sends them as the numbers 100 and 1500.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)
