"""Render a model's Jinja chat template exactly as `transformers.apply_chat_template` does, within bounds.

Templates come from the hub and are untrusted code: they run in Jinja's immutable sandbox, with only
the helpers transformers gives them (`raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape, a `namespace` that refuses underscore names). Each render is also bounded in steps,
characters written and the size of every value it makes (`template_bounds.TemplateLimits`: two
nested `range(100000)` loops or `'a' * 4000000000` end in a ChatTemplateLimitError naming the limit,
within a second or so and without the memory). Real templates stay far inside those bounds and
render as before.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext

from kvasir.runtime.loader.template_bounds import (
    BoundedSandbox,
    LimitExceeded,
    as_int,
    current_limits,
    need_chars,
    render_budget,
    text_bound,
)


class ChatTemplateError(ValueError):
    """No template, a template that does not compile, or one that refused these messages
    (e.g. `raise_exception('roles must alternate')`)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A render that went past one of its limits (the message names the limit)."""


def render_chat_template(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Render `template` for `messages`; `variables` are `add_generation_prompt`, tokens, tools...

    Raises ChatTemplateError for a template that fails or refuses, ChatTemplateLimitError for one
    that goes past its bounds."""
    compiled = _compile(template)
    try:
        with render_budget():
            return compiled.render(messages=messages, **variables)
    except LimitExceeded as error:
        raise ChatTemplateLimitError(f"chat template: {error}") from error
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template: {error}") from error
    except Exception as error:  # the template's own fault on these messages: TypeError, RecursionError...
        raise ChatTemplateError(f"chat template: {type(error).__name__}: {error}") from error


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
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which would change what the model sees.
    limit = current_limits().max_json_indent
    width = len(indent) if isinstance(indent, str) else max(as_int(indent) or 0, 0)
    separator = sum(len(part) for part in separators) if separators else 2
    if width > limit or separator > limit:
        raise LimitExceeded(
            f"tojson: an indent or separators of more than {limit} characters (the tojson indent limit)"
        )
    need_chars(text_bound(value, indent=width, separator=separator, ascii_only=ensure_ascii), "tojson")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    need_chars(len(fmt) + 64 * fmt.count("%"), "strftime_now")
    return datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # Jinja's names
    need_chars(_count(n) * _count(max) * 16, "lipsum")
    return str(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))


def _count(value: Any) -> int:
    return max(as_int(value) or 0, 0)


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        filters={"tojson": _tojson},
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["lipsum"] = _lipsum
    return env
