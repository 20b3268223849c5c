"""Bounds on the shape of a JSON request body, checked on its bytes before any Python object exists.

Torch-free and framework-free: `kvasir serve` reads it through `json_shape` (which answers in its
own error type) and `kvasir router` uses it directly, so both refuse the same bodies.

Parsing amplifies: `{}` is 2 bytes of JSON and a 64-byte dict, and pydantic, the chat template and
the tokenizer each walk again what `json.loads` built. A 32 MB body of 2M empty chat messages cost
gigabytes and minutes before it was refused; one nested 1,000 deep made `json.loads` (and any
recursive walk) overflow the stack. No real request comes near these bounds (docs/serving.md):

- `MAX_DEPTH` nested objects and arrays;
- `MAX_CONTAINERS` objects and arrays in the whole body (messages, content parts, prompt lists);
- `MAX_VALUES` array elements and object members in the whole body (token ids above all);
- `MAX_STRINGS` strings in the whole body, keys included (each is a Python object of its own);
- `MAX_MEMBERS` members in any one object (OpenAI's `metadata` allows 16).

Within them, decoding and validating any body under the size cap costs tens of megabytes and well
under a second. Almost every body is cleared by five `bytes.count` calls (counts that include the
bytes inside strings can only be larger). The rest is walked once, one regular-expression match per
bracket and per run of up to `_RUN_ITEMS` strings and plain stretches between brackets (matched in
C, a string whole however long), and the walk stops at the first bound passed: its cost is bounded
by the bounds, not by the body, and no single step holds the interpreter for long.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvasir.runtime.server.printable import printable

MAX_DEPTH = 64
MAX_CONTAINERS = 1 << 14
MAX_VALUES = 1 << 20
MAX_STRINGS = 1 << 18
MAX_MEMBERS = 1 << 10


@dataclass(frozen=True)
class ShapeBounds:
    max_depth: int = MAX_DEPTH
    max_containers: int = MAX_CONTAINERS
    max_values: int = MAX_VALUES
    max_strings: int = MAX_STRINGS
    max_members: int = MAX_MEMBERS


class ShapeError(ValueError):
    """A body past a bound: `message` says which and where, `param` names its top-level field (if any)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


DEFAULT_BOUNDS = ShapeBounds()

# Possessive quantifiers throughout: no backtracking state is kept, however many escapes a string has.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_STRINGS = re.compile(_STRING, re.DOTALL)
_SHORT_STRING = rb'"(?:[^"\\]|\\.){0,256}+"'
_RUN_ITEMS = 512
# A bracket; a run of up to _RUN_ITEMS plain stretches and short strings; or one long string, alone
# (so that it is scanned once, and never again to count the commas outside strings).
_RUN = rb'(?:[^"\[\]{}]++|%s){1,%d}+' % (_SHORT_STRING, _RUN_ITEMS)
_TOKENS = re.compile(
    rb"(?P<open>[\[{])|(?P<close>[\]}])|(?P<run>%s)|(?P<string>%s)" % (_RUN, _STRING), re.DOTALL
)
_PATH_SHOWN = 6  # labels of a path shown in an error message
_LABEL_CHARS = 40  # characters of one key shown


class _Frame:
    """One open object or array: how its parent names it, and what it has held so far."""

    __slots__ = ("colons", "commas", "is_object", "label", "nonempty", "start")

    def __init__(self, is_object: bool, start: int, label: int | tuple[int, int] | None) -> None:
        self.is_object = is_object
        self.start = start
        # An array index, or where to look for the key (decoded only for an error message).
        self.label = label
        self.commas = 0
        self.colons = 0
        self.nonempty = False  # it holds an item: its items are its commas + 1


def check_shape(body: bytes, bounds: ShapeBounds = DEFAULT_BOUNDS) -> None:
    """Raise ShapeError if `body` passes a bound; otherwise return.

    Invalid JSON is not judged here: `json.loads` refuses it, and builds nothing past the point where
    this walk and the parser part ways."""
    opens = body.count(b"{") + body.count(b"[")
    if (
        opens <= bounds.max_depth
        and opens + body.count(b",") <= bounds.max_values
        and body.count(b":") <= bounds.max_members
        and body.count(b'"') <= 2 * bounds.max_strings
    ):
        return
    _walk(body, bounds)


def _walk(body: bytes, bounds: ShapeBounds) -> None:
    stack: list[_Frame] = []
    containers = values = strings = 0
    for match in _TOKENS.finditer(body):
        kind = match.lastgroup
        if kind == "close":
            if stack:
                stack.pop()
            continue
        if kind == "open":
            containers += 1
            if containers > bounds.max_containers:
                _refuse(body, stack, f"holds more than {bounds.max_containers} objects and arrays")
        if kind == "string":
            plain, count = b"", 1
        elif kind == "run":
            run = match.group()
            plain, count = _STRINGS.subn(b"", run) if b'"' in run else (run, 0)
        else:
            plain, count = b"", 0
        strings += count
        if strings > bounds.max_strings:
            _refuse(body, stack, f"holds more than {bounds.max_strings} strings")
        if stack:  # an item of the innermost open container (anything outside the top value is invalid)
            frame = stack[-1]
            if not frame.nonempty and (count or kind == "open" or plain.strip()):
                frame.nonempty = True
                values += 1
            commas = plain.count(b",")
            frame.commas += commas
            values += commas
            if values > bounds.max_values:
                _refuse(body, stack, f"holds more than {bounds.max_values} array elements and object members")
            if frame.is_object:
                frame.colons += plain.count(b":")
                if frame.colons > bounds.max_members:
                    what = "fields" if len(stack) == 1 else "members in one object"
                    _refuse(body, stack, f"has more than {bounds.max_members} {what}")
        if kind == "open":
            parent = stack[-1] if stack else None
            label: int | tuple[int, int] | None = None
            if parent is not None:
                label = (parent.start, match.start()) if parent.is_object else parent.commas
            stack.append(_Frame(match.group() == b"{", match.start(), label))
            if len(stack) > bounds.max_depth:
                _refuse(body, stack, f"nests objects and arrays more than {bounds.max_depth} deep")


def _refuse(body: bytes, stack: list[_Frame], what: str) -> None:
    labels = [_label(body, frame.label) for frame in stack[1 : _PATH_SHOWN + 1]]
    where = ".".join(labels) + (".…" if len(stack) > _PATH_SHOWN + 1 else "")
    raise ShapeError(
        f"The request body {what}"
        + (f" (at {where})" if where else "")
        + "; see the limits in docs/serving.md.",
        param=labels[0] if labels and stack[0].is_object else None,  # a field of the body, if any
    )


def _label(body: bytes, label: int | tuple[int, int] | None) -> str:
    """How an error names one step of the path: an index, or the key (the last string between the
    parent object's start and the container's), shortened and made printable."""
    if isinstance(label, int):
        return str(label)
    if not isinstance(label, tuple):
        return "?"
    keys = list(_STRINGS.finditer(body, *label))
    if not keys:
        return "?"
    raw = keys[-1].group()
    try:
        key = str(json.loads(raw))
    except ValueError:
        key = raw[1:-1].decode("utf-8", "replace")
    return printable(key, _LABEL_CHARS)
