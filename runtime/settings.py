"""Settings declared once, on the config dataclass field they fill.

A field declared with `setting(...)` carries its `Flag`: the command-line flag named after the
field (`max_model_len` is `--max-model-len`), its `KVASIR_*` environment variable, its type,
choices, range and help. From that one declaration come the argument parser (`add_flag`), the
dataclass's own validation (`check_settings`), the config built from parsed arguments
(`config_from_args`) and what the operator may put in a pod. Torch-free: the operator imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar


def env_name(flag: str) -> str:
    """The environment variable that sets a flag: `--max-model-len` is `KVASIR_MAX_MODEL_LEN`."""
    return "KVASIR_" + flag.lstrip("-").replace("-", "_").upper()


# What a boolean KVASIR_* variable may hold (any case, surrounding blanks ignored).
BOOL_WORDS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def parse_bool(value: str, name: str) -> bool:
    """`value` of the boolean variable `name`; ValueError naming it for anything but BOOL_WORDS."""
    word = value.strip().lower()
    if word not in BOOL_WORDS:
        raise ValueError(f"{name} must be one of 1/0/true/false/yes/no/on/off, got {value!r}")
    return BOOL_WORDS[word]


def env_bool(name: str, default: bool, env: Mapping[str, str] = os.environ) -> bool:
    """The boolean environment variable `name` (`default` when unset); ValueError naming it for junk."""
    value = env.get(name)
    return default if value is None else parse_bool(value, name)


class BadEnvironment:
    """A flag's default when its KVASIR_* variable holds a value the flag refuses. The error is kept,
    not raised, so that only the command that reads the flag fails (and a value given on the
    command line replaces it): `kvasir` reports it in one line, `config_from_args` raises it."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"BadEnvironment({self.message!r})"


def bad_environment(args: argparse.Namespace) -> str | None:
    """The message of the first flag whose default came from an unusable KVASIR_* variable."""
    for value in vars(args).values():
        if isinstance(value, BadEnvironment):
            return value.message
    return None


@dataclass(frozen=True)
class Flag:
    """One flag: its type, default, allowed values or range, and help.

    A `bool` flag is a switch with a `--no-` form; any other type converts the flag's text."""

    name: str
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    help: str = ""
    multiple: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.name)

    def check(self, value: Any, label: str | None = None) -> Any:
        """`value` if it is allowed, else ValueError naming `label` (the flag) and the rule."""
        label = label or self.name
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{label} must be a finite number, got {value}")
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(str(c) for c in self.choices)
            raise ValueError(f"{label} must be one of {allowed}, got {value!r}")
        low, high = self.minimum, self.maximum
        if isinstance(value, bool) and (low is not None or high is not None):
            raise ValueError(f"{label} must be a number, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                raise ValueError(f"{label} must be at least {_bound(low)}, got {value}")
            if low is None:
                raise ValueError(f"{label} must be at most {_bound(high)}, got {value}")
            raise ValueError(f"{label} must be between {_bound(low)} and {_bound(high)}, got {value}")
        return value

    def convert(self, text: str, label: str | None = None) -> Any:
        """One value given as text (a flag's or an environment variable's), converted and checked;
        ValueError naming `label` (the flag)."""
        label = label or self.name
        try:
            value = self.type(text)
        except ValueError:
            if self.type is int:
                raise ValueError(f"{label} must be an integer, got {text!r}") from None
            if self.type is float:
                raise ValueError(f"{label} must be a number, got {text!r}") from None
            raise  # a parser of its own (JSON settings): its message names what is wrong
        except RecursionError:  # a parser of its own on text nested deeper than it can walk
            raise ValueError(f"{label} is nested too deeply") from None
        return self.check(value, label)

    def parse(self, text: str) -> Any:
        """argparse's `type`: convert and check one command-line value."""
        try:
            return self.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


def _bound(number: float | None) -> str:
    """A range's end as written: 16777216, not 1.67772e+07; 0.01 as 0.01."""
    assert number is not None  # called for a bound that is set
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e15 else f"{number:g}"


def setting(
    default: Any = None,
    *,
    type: Callable[[str], Any] = str,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    help: str = "",
    name: str | None = None,
    multiple: bool = False,
) -> Any:
    """A dataclass field that is also a flag; the flag's name is filled in by `flags_of`."""
    flag = Flag(
        name or "", type=type, choices=choices, minimum=minimum, maximum=maximum, help=help, multiple=multiple
    )
    return dataclasses.field(default=default, metadata={"flag": flag})


def flags_of(config_type: type) -> tuple[Flag, ...]:
    """The flags declared on a config dataclass's fields, with their names and defaults filled in."""
    flags = []
    for field in dataclasses.fields(config_type):
        flag = field.metadata.get("flag")
        if flag is None:
            continue
        name = flag.name or "--" + field.name.replace("_", "-")
        default = None if field.default is dataclasses.MISSING else field.default
        flags.append(dataclasses.replace(flag, name=name, default=default))
    return tuple(flags)


def check_settings(config: Any) -> None:
    """Check every set field of `config` against its flag's choices and range.

    The ValueError names the field, as the caller of the Python API spelled it."""
    for flag in flags_of(type(config)):
        value = getattr(config, flag.dest)
        if value is not None and flag.type is not bool:
            flag.check(value, flag.dest)


T = TypeVar("T")


def config_from_args(config_type: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build `config_type` from parsed arguments: every flag's value, then `overrides`."""
    flags = flags_of(config_type)
    values = {flag.dest: getattr(args, flag.dest) for flag in flags}
    for value in values.values():
        if isinstance(value, BadEnvironment):
            raise ValueError(value.message)
    for flag in flags:
        if flag.multiple and values[flag.dest] is not None:
            values[flag.dest] = tuple(values[flag.dest])
    return config_type(**{**values, **overrides})


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: Flag) -> None:
    """Add `flag` to `parser`; its `KVASIR_<FLAG>` environment variable, when set, is the default
    (a value the flag refuses becomes a `BadEnvironment`, naming the variable)."""
    env = os.environ.get(flag.env)
    default: Any = flag.default
    if env is not None:
        try:
            if flag.type is bool:
                default = parse_bool(env, flag.env)
            elif flag.multiple:
                default = tuple(flag.convert(item, flag.env) for item in shlex.split(env))
            else:
                default = flag.convert(env, flag.env)
        except ValueError as exc:
            message = str(exc)
            default = BadEnvironment(message if flag.env in message else f"{flag.env}: {message}")
    if flag.type is bool:
        state = "on" if flag.default else "off"  # a None default (decided later) says so in its help
        help_text = flag.help if "default" in flag.help else f"{flag.help} (default: {state})".lstrip()
        parser.add_argument(flag.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return
    help_text = flag.help
    if flag.multiple:
        # A list default: argparse's "extend" appends to it (a copy), each value checked by `parse`.
        values = list(default) if isinstance(default, tuple) else default
        parser.add_argument(
            flag.name, type=flag.parse, default=values, help=help_text, nargs="+", action="extend"
        )
        return
    if flag.default is not None and "default" not in help_text:
        help_text = f"{help_text} (default: %(default)s)".lstrip()
    parser.add_argument(flag.name, type=flag.parse, default=default, help=help_text, metavar=_metavar(flag))


def _metavar(flag: Flag) -> str | None:
    if flag.choices is not None:
        return "{" + ",".join(str(c) for c in flag.choices) + "}"
    return None
