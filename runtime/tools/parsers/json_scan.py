"""Incremental JSON scanning, one character at a time, for tool calls written by a model.

The parsers never re-serialize a call's arguments: they forward the exact characters the model
wrote for the arguments value, so a streamed call and the whole answer agree byte for byte. That
needs to know, character by character, where the value starts and ends, which is what these
scanners track: strings (with escapes) and bracket nesting. They check structure, not the full
JSON grammar: `{"a" 1}` passes as one balanced value (OpenAI gives no validity promise for
arguments either), but a mismatched bracket or a value that cannot start a JSON value fails.
"""

from __future__ import annotations

import enum
import json

JSON_WHITESPACE = frozenset(" \t\n\r")
_CLOSES = {"}": "{", "]": "["}
# Characters of numbers and of the literals true, false and null.
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")
_SCALAR_START = frozenset("-0123456789tfn")


class Scan(enum.Enum):
    """What one character did to the value being scanned."""

    MORE = "more"  # consumed; the value goes on
    DONE = "done"  # consumed, and it completed the value
    BEFORE = "before"  # not consumed: the value (a bare number or literal) ended just before it
    ERROR = "error"  # the text cannot be this value


class JsonValueScanner:
    """Follows one JSON value; the caller skips whitespace before its first character."""

    def __init__(self) -> None:
        self.first: str | None = None  # the value's first character: its kind
        self._stack: list[str] = []
        self._in_string = False
        self._escaped = False

    @property
    def in_string(self) -> bool:
        """Whether the next character is inside a string (where any text, markers too, is data)."""
        return self._in_string

    def push(self, char: str) -> Scan:
        if self.first is None:
            self.first = char
            if char in "{[":
                self._stack.append(char)
            elif char == '"':
                self._in_string = True
            elif char not in _SCALAR_START:
                return Scan.ERROR
            return Scan.MORE
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if not self._stack:
                    return Scan.DONE
            return Scan.MORE
        if not self._stack:  # a bare number or literal: it ends at the first other character
            return Scan.MORE if char in _SCALAR_CHARS else Scan.BEFORE
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._stack.append(char)
        elif char in _CLOSES:
            if self._stack[-1] != _CLOSES[char]:
                return Scan.ERROR
            self._stack.pop()
            if not self._stack:
                return Scan.DONE
        return Scan.MORE


class CallObjectScanner:
    """Follows one call object, `{"name": "f", "arguments": {...}}`, and pulls out its parts.

    Keys may come in any order and unknown keys are skipped; the arguments key is any of
    `argument_keys`. The arguments value must be an object (its exact text is the arguments) or a
    string (some models write the arguments JSON-encoded; its decoded text is the arguments, known
    only once the string ends). A call without arguments has arguments "{}".

    Contract: `push` each character; the call may be announced once `header_ready` (its name is
    known and its arguments have begun, or the object has ended); from then on `take_arguments`
    returns the argument text not taken before. `push` answers DONE on the object's closing brace
    and ERROR when the text cannot be such a call (no name, a name that is not a non-empty string,
    a repeated name or arguments key, arguments neither an object nor a string, bad syntax).
    """

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self._argument_keys = argument_keys
        self._state = "open"  # open, key_or_end, key, colon, value, comma_or_end, done
        self._key_raw: list[str] = []
        self._key = ""
        self._value: JsonValueScanner | None = None
        self._value_raw: list[str] = []  # a name's or string arguments' text, decoded at its end
        self.name: str | None = None
        self._arguments_kind: str | None = None  # "object", "string" or "absent"
        self._pending: list[str] = []
        self.done = False

    @property
    def in_string(self) -> bool:
        return self._state == "key" or (self._value is not None and self._value.in_string)

    @property
    def header_ready(self) -> bool:
        return self.name is not None and (self._arguments_kind is not None or self.done)

    def take_arguments(self) -> str:
        """Argument text since the last call; "" until `header_ready`."""
        if not self.header_ready:
            return ""
        text = "".join(self._pending)
        self._pending.clear()
        return text

    def push(self, char: str) -> Scan:
        state = self._state
        if state == "value":
            return self._push_value(char)
        if state == "key":
            if self._key_raw and self._key_raw[-1] == "\\" and _escaping(self._key_raw):
                self._key_raw.append(char)
            elif char == '"':
                key = _decode_string('"' + "".join(self._key_raw) + '"')
                if key is None:
                    return Scan.ERROR
                self._key, self._state = key, "colon"
            else:
                self._key_raw.append(char)
            return Scan.MORE
        if char in JSON_WHITESPACE:
            return Scan.ERROR if state == "done" else Scan.MORE
        if state == "open":
            self._state = "key_or_end"
            return Scan.MORE if char == "{" else Scan.ERROR
        if state == "colon":
            self._state = "before_value"
            return Scan.MORE if char == ":" else Scan.ERROR
        if state == "before_value":
            return self._start_value(char)
        if state in ("key_or_end", "comma_or_end") and char == "}":
            return self._end()
        if state == "comma_or_end" and char == ",":
            self._state = "key_or_end"
            return Scan.MORE
        if state == "key_or_end" and char == '"':
            self._key_raw.clear()
            self._state = "key"
            return Scan.MORE
        return Scan.ERROR

    def _start_value(self, char: str) -> Scan:
        if self._key == "name" and (self.name is not None or char != '"'):
            return Scan.ERROR
        if self._key in self._argument_keys:
            if self._arguments_kind is not None or char not in '{"':
                return Scan.ERROR
            self._arguments_kind = "object" if char == "{" else "string"
        self._value = JsonValueScanner()
        self._value_raw.clear()
        self._state = "value"
        return self._push_value(char)

    def _push_value(self, char: str) -> Scan:
        assert self._value is not None
        step = self._value.push(char)
        if step is Scan.ERROR:
            return step
        is_arguments = self._key in self._argument_keys
        if step is not Scan.BEFORE:
            if is_arguments and self._arguments_kind == "object":
                self._pending.append(char)
            elif self._key == "name" or is_arguments:
                self._value_raw.append(char)
        if step is Scan.MORE:
            return step
        self._value = None
        self._state = "comma_or_end"
        if self._key == "name":
            self.name = _decode_string("".join(self._value_raw))
            if not self.name:
                return Scan.ERROR
        elif is_arguments and self._arguments_kind == "string":
            arguments = _decode_string("".join(self._value_raw))
            if arguments is None:
                return Scan.ERROR
            self._pending.append(arguments)
        return self.push(char) if step is Scan.BEFORE else Scan.MORE

    def _end(self) -> Scan:
        if self.name is None:
            return Scan.ERROR
        if self._arguments_kind is None:
            self._arguments_kind = "absent"
            self._pending.append("{}")
        self._state = "done"
        self.done = True
        return Scan.DONE


def _escaping(raw: list[str]) -> bool:
    """Whether the backslashes ending `raw` leave the next character escaped (an odd run)."""
    run = 0
    for char in reversed(raw):
        if char != "\\":
            break
        run += 1
    return run % 2 == 1


def _decode_string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
