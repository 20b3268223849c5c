"""Render a model's Jinja chat template exactly as `transformers.apply_chat_template` does.

Templates come from the hub and are untrusted code: they run in Jinja's immutable sandbox, with only
the helpers transformers gives them (`raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape, a `namespace` that refuses underscore names).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No template, a template that does not compile, or one that refused these messages
    (e.g. `raise_exception('roles must alternate')`)."""


def render_chat_template(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Render `template` for `messages`; `variables` are `add_generation_prompt`, tokens, tools..."""
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, **variables)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template: {error}") from error


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"the model's chat template has a syntax error at line {error.lineno}: {error}"
        ) from error


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` markers, rendering their body."""

    tags = {"generation"}  # noqa: RUF012 - the type Jinja declares

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore attributes so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # `self` comes in *args, as in Jinja
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which would change what the model sees.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env
