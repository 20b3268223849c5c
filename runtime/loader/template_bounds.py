"""Bounds on one chat-template render: steps, characters written, and the size of every value.

Jinja's sandbox keeps a template from reaching Python's internals, not from running forever or
filling memory: two nested `range(100000)` loops never end, `'a' * 4000000000` asks for gigabytes.
`BoundedSandbox` counts and checks what a render does, against a budget set up per render by
`render_budget` (`TemplateLimits`; past any limit, `LimitExceeded`, whose message names it):

- steps: each loop iteration, call (macros included), filter, test and arithmetic operation is a
  step, plus one per 1024 characters or items it reads or produces (work follows the data's size);
- characters written: the output, and everything the template writes into `{% set %}` blocks,
  macros and call blocks on the way (each expression's text, each pass over a body's literal text);
- the size of each value an operation produces: strings, lists, dicts, integers. The operations
  that can ask for far more than their inputs hold (`*`, `**`, `+`, `%` and `str.format`, `~`,
  `replace`, `join`, `expandtabs`, padding widths, `split`, `indent`, printing a container) are
  checked on their arguments first, so a value over a limit is never built. `range` keeps Jinja's
  own bound (100,000 items).

How: the compiler is given a rewritten tree (`_Instrument`: a charge at the start of every loop
iteration, macro and call block, checks around `~` and comparisons); calls and arithmetic go
through the sandbox's `call` and `call_binop`, every filter and test through a counting wrapper,
every `{{ expression }}` through `finalize`. The checks only read values and count, so what a
template renders is unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
import string
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_context, pass_environment
from jinja2.visitor import NodeTransformer

# Strings this short pass any string size limit (a shortcut for the common case; TemplateLimits
# refuses a smaller limit).
_SMALLEST_STRING_LIMIT = 1024


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may use (see the module docstring)."""

    max_steps: int = 1_000_000
    max_output_chars: int = 64 << 20
    max_string_chars: int = 16 << 20
    max_items: int = 1 << 20
    max_int_bits: int = 1 << 16
    # tojson's indent and separators: no template needs more, and each repeats on every line.
    max_json_indent: int = 64

    def __post_init__(self) -> None:
        if self.max_string_chars < _SMALLEST_STRING_LIMIT:
            raise ValueError(f"max_string_chars must be at least {_SMALLEST_STRING_LIMIT}")


LIMITS = TemplateLimits()
# One step per this many characters or items an operation reads or produces.
CHARS_PER_STEP = 1024
# Values whose text size `text_bound` adds up per step (each takes a fraction of a step's time).
_NODES_PER_STEP = 4


class LimitExceeded(jinja2.exceptions.SecurityError):
    """A render went past one of its limits; the message names the limit."""


class Budget:
    """Steps taken and characters written so far by one render."""

    __slots__ = ("limits", "steps", "written")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.written = 0

    def step(self, count: int) -> None:
        self.steps += count
        if self.steps > self.limits.max_steps:
            raise LimitExceeded(
                f"the render took more than {self.limits.max_steps:,} steps (loop iterations, calls, "
                "filters and operations, one more per 1024 characters they handle): the render step limit"
            )

    def write(self, chars: int) -> None:
        self.written += chars
        if self.written > self.limits.max_output_chars:
            raise LimitExceeded(
                f"the render wrote more than {self.limits.max_output_chars:,} characters "
                "(its output and the text it captures in variables): the render output limit"
            )


# The budget of the render running in this thread (None outside renders: compile-time folding).
_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("kvasir_chat_budget", default=None)


@contextmanager
def render_budget(limits: TemplateLimits = LIMITS) -> Iterator[Budget]:
    """The budget of the render made inside this block (in this thread)."""
    budget = Budget(limits)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def _charge(steps: int) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step(steps)


def current_limits() -> TemplateLimits:
    budget = _BUDGET.get()
    return budget.limits if budget is not None else LIMITS


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _size(value: Any) -> int:
    """Characters or items in `value` (0 for scalars): what a step is charged for."""
    return len(value) if isinstance(value, _SIZED) else 0


def need_chars(chars: int, what: str) -> None:
    if chars <= _SMALLEST_STRING_LIMIT:
        return
    limit = current_limits().max_string_chars
    if chars > limit:
        raise LimitExceeded(
            f"{what} would make a string of {chars:,} characters, over the string size limit ({limit:,})"
        )


def need_items(items: int, what: str) -> None:
    limit = current_limits().max_items
    if items > limit:
        raise LimitExceeded(f"{what} would make {items:,} items, over the list size limit ({limit:,})")


def need_bits(bits: int, what: str) -> None:
    limit = current_limits().max_int_bits
    if bits > limit:
        raise LimitExceeded(
            f"{what} would make an integer of {bits:,} bits, over the integer size limit ({limit:,})"
        )


def produced(value: Any, *inputs: Any) -> Any:
    """Check a value an operation produced against the size limits and charge its steps (one, plus
    one per CHARS_PER_STEP characters or items of `value` and of the `inputs` it read)."""
    budget = _BUDGET.get()
    limits = budget.limits if budget is not None else LIMITS
    work = 0
    if isinstance(value, str | bytes):
        work = len(value)
        if work > limits.max_string_chars:
            need_chars(work, "this operation")
    elif isinstance(value, _CONTAINERS):
        work = len(value)
        if work > limits.max_items:
            need_items(work, "this operation")
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > limits.max_int_bits:
        need_bits(value.bit_length(), "this operation")
    if budget is not None:
        for item in inputs:
            if isinstance(item, _SIZED):
                work += len(item)
        budget.step(1 + work // CHARS_PER_STEP)
    return value


def text_bound(value: Any, *, indent: int = 0, separator: int = 2, ascii_only: bool = False) -> int:
    """An upper bound on the characters `str(value)`, `repr`, `pprint` or `json.dumps` (with that
    indent and separator width) write for `value`, found without writing them; it stops counting
    past the string size limit. A list holding one long string 1000 times is 1000 long strings."""
    limit = current_limits().max_string_chars
    total, nodes_seen = 0, 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and total <= limit:
        item, depth = stack.pop()
        nodes_seen += 1
        total += indent * depth + separator + 2
        if isinstance(item, str):
            printable = item.isprintable() and (item.isascii() or not ascii_only)
            total += len(item) * (2 if printable else 12)  # escapes: \\ or \" ; \u00XX, \ud83d\ude00
        elif isinstance(item, bytes):
            total += 4 * len(item)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, dict):
            stack.extend((part, depth + 1) for pair in item.items() for part in pair)
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((part, depth + 1) for part in item)
        elif isinstance(item, jinja2.utils.Namespace):
            stack.append((object.__getattribute__(item, "_Namespace__attrs"), depth))
        else:
            total += 64
    _charge(nodes_seen // _NODES_PER_STEP)
    return total


def need_text(value: Any, what: str, **options: Any) -> None:
    """Refuse to turn `value` into text when that text could exceed the string size limit."""
    if isinstance(value, str):
        return
    need_chars(text_bound(value, **options), what)


# --- arguments checked before an operation runs -------------------------------------------------


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_repeat(sequence: Any, times: Any) -> None:
    count = as_int(times)
    if count is not None and isinstance(sequence, str | bytes):
        need_chars(len(sequence) * max(count, 0), "repeating a string")
    elif count is not None and isinstance(sequence, list | tuple):
        need_items(len(sequence) * max(count, 0), "repeating a list")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        _check_repeat(left, right)
        _check_repeat(right, left)
        if as_int(left) is not None and as_int(right) is not None:
            need_bits(left.bit_length() + right.bit_length(), "multiplying")
    elif operator == "**":
        base, exponent = as_int(left), as_int(right)
        if base is not None and exponent is not None and exponent > 0 and abs(base) > 1:
            need_bits((abs(base).bit_length() - 1) * exponent, "raising to a power")
    elif operator == "+":
        if isinstance(left, str | bytes) and isinstance(right, str | bytes):
            need_chars(len(left) + len(right), "adding strings")
        elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
            need_items(len(left) + len(right), "adding lists")
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)


# A %-format placeholder: its width and precision (digits, or `*` taken from the arguments).
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*|\*)(?:\.(\d*|\*))?[a-zA-Z%]")
_DIGITS = re.compile(r"\d+")


def _widest(numbers: Iterable[str], values: Iterable[Any]) -> int:
    """The largest width or precision a format asks for: from its specs or (`*`, nested fields)
    from its integer arguments."""
    written = [int(run) if len(run) <= 9 else 1 << 62 for run in numbers if run]  # 10+ digits: over any limit
    given = [abs(n) for n in (as_int(v) for v in values) if n is not None]
    return max([0, *written, *given])


def _check_format(fmt: str, fields: int, widths: list[str], values: list[Any]) -> None:
    """`fields` placeholders, each at most as wide as the widest value or the largest width."""
    if fields == 0:
        return
    longest = max((text_bound(value) for value in values), default=0)
    need_chars(len(fmt) + fields * (longest + _widest(widths, values)), "formatting")


def _check_percent(fmt: str, args: Any) -> None:
    values = (
        list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    )
    fields = [match for match in _PERCENT_FIELD.finditer(fmt) if match[0] != "%%"]
    widths = [group for match in fields for group in match.groups("") if group != "*"]
    _check_format(fmt, len(fields), widths, values)


def _check_brace_format(fmt: str, values: list[Any]) -> None:
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format refuses it the same way
    specs = [spec or "" for _, name, spec, _ in parsed if name is not None]
    widths = [run for spec in specs for run in _DIGITS.findall(spec)]
    _check_format(fmt, len(specs), widths, values)


def _check_replace(text: str | bytes, old: Any, new: Any, count: Any = -1) -> None:
    if not isinstance(old, str | bytes) or not isinstance(new, str | bytes):
        return
    occurrences = text.count(old) if old else len(text) + 1  # type: ignore[arg-type]
    limit = as_int(count)
    if limit is not None and limit >= 0:
        occurrences = min(occurrences, limit)
    need_chars(len(text) + occurrences * max(len(new) - len(old), 0), "replace")


def _materialize(items: Iterable[Any], what: str) -> list[Any]:
    taken = list(islice(items, current_limits().max_items + 1))
    need_items(len(taken), what)
    return taken


def _check_join(separator: Any, items: list[Any]) -> None:
    sep = len(separator) if isinstance(separator, str | bytes) else len(str(separator))
    total = sep * max(len(items) - 1, 0)
    for item in items:
        total += len(item) if isinstance(item, str | bytes) else text_bound(item)
        if total > current_limits().max_string_chars:
            break
    need_chars(total, "join")


_LINE_BREAKS = ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def _check_str_method(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Check a call of a str (or bytes) method whose result could outgrow the string; returns the
    arguments to call it with (an iterable given to `join` is read into a list first)."""
    text, name = method.__self__, method.__name__
    given = dict(enumerate(args))

    def arg(position: int, keyword: str, default: Any = None) -> Any:
        return given.get(position, kwargs.get(keyword, default))

    if name == "replace":
        _check_replace(text, arg(0, "old"), arg(1, "new"), arg(2, "count", -1))
    elif name == "join" and args:
        items = _materialize(args[0], "join")
        _check_join(text, items)
        return (items, *args[1:])
    elif name == "expandtabs":
        tabsize = as_int(arg(0, "tabsize", 8)) or 0
        tabs = text.count("\t" if isinstance(text, str) else b"\t")
        need_chars(len(text) + tabs * max(tabsize, 0), "expandtabs")
    elif name in ("center", "ljust", "rjust", "zfill"):
        width = as_int(arg(0, "width", 0))
        if width is not None:
            need_chars(width, name)
    elif name in ("split", "rsplit") and isinstance(text, str):
        sep, maxsplit = arg(0, "sep"), as_int(arg(1, "maxsplit", -1))
        parts = text.count(sep) + 1 if isinstance(sep, str) and sep else len(text) // 2 + 1
        if maxsplit is not None and maxsplit >= 0:
            parts = min(parts, maxsplit + 1)
        need_items(parts, name)
    elif name == "splitlines" and isinstance(text, str):
        need_items(sum(text.count(mark) for mark in _LINE_BREAKS) + 1, name)
    elif name == "translate" and isinstance(arg(0, "table"), dict):
        widest = max((len(v) for v in arg(0, "table").values() if isinstance(v, str)), default=1)
        need_chars(len(text) * max(widest, 1), name)
    elif name in ("maketrans", "fromkeys") and args:
        need_items(_size(args[0]), name)
    return args


# --- the compiled template: loops, macros, `~`, comparisons and output report to the budget --------


# The filters the compiler inserts (names no template can spell).
_CHARGE, _STEP, _CONCAT, _TOUCH = "kvasir:charge", "kvasir:step", "kvasir:concat", "kvasir:touch"


@pass_context
def _charge_filter(context: Any, chars: int) -> None:
    """At the start of each pass over a body: one step, and its literal text written."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.step(1)
        budget.write(chars)


@pass_context
def _step_filter(context: Any, value: Any) -> Any:
    _charge(1)
    return value


@pass_context
def _concat_filter(context: Any, parts: list[Any]) -> str:
    """`~`: the operands' text must fit before `str()` and the join write it."""
    total = 0
    for part in parts:
        total += len(part) if isinstance(part, str) else text_bound(part)
    need_chars(total, "joining with ~")
    return str(produced("".join(map(str, parts)), *parts))


@pass_context
def _touch_filter(context: Any, value: Any) -> Any:
    """An operand of a comparison (`in`, `==`): charged for its size."""
    if isinstance(value, _SIZED) and len(value) >= CHARS_PER_STEP:
        _charge(len(value) // CHARS_PER_STEP)
    return value


_INTERNAL_FILTERS = {
    _CHARGE: _charge_filter,
    _STEP: _step_filter,
    _CONCAT: _concat_filter,
    _TOUCH: _touch_filter,
}


def _filter_node(node: nodes.Node, name: str, *args: nodes.Expr) -> nodes.Filter:
    return nodes.Filter(node, name, list(args), [], None, None, lineno=node.lineno)


def _literal_chars(body: list[nodes.Node]) -> int:
    """The literal text a body writes per pass (its nested loops, macros and call blocks count
    their own): template data, and constant expressions Jinja folds into it."""
    total = 0
    pending: list[nodes.Node] = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, nodes.TemplateData):
            total += len(node.data)
        elif isinstance(node, nodes.Const) and isinstance(node.value, str):
            total += len(node.value)
        elif isinstance(node, nodes.For):
            pending.extend(node.else_)  # the body is its own scope; `else` runs in this one
        elif not isinstance(node, nodes.Macro | nodes.CallBlock | nodes.Block):
            pending.extend(node.iter_child_nodes())
    return total


class _Instrument(NodeTransformer):
    """Rewrite a parsed template so that its loops, macros and operators report to the budget."""

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        # `a ~ b ~ c` is Jinja's str_join((a, b, c)); the filter joins the same way once the
        # operands' text is known to fit.
        self.generic_visit(node)
        return _filter_node(nodes.List(node.nodes, lineno=node.lineno), _CONCAT)

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        self.generic_visit(node)
        node.expr = _filter_node(node.expr, _TOUCH)
        for operand in node.ops:
            operand.expr = _filter_node(operand.expr, _TOUCH)
        return node

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        _charge_each_pass(node)
        if node.test is not None:  # `for x in xs if test`: skipped items are steps too
            node.test = _filter_node(node.test, _STEP)
        return node

    def visit_Macro(self, node: nodes.Macro) -> nodes.Node:
        self.generic_visit(node)
        _charge_each_pass(node)
        return node

    def visit_CallBlock(self, node: nodes.CallBlock) -> nodes.Node:
        self.generic_visit(node)
        _charge_each_pass(node)
        return node

    def visit_Block(self, node: nodes.Block) -> nodes.Node:  # `self.name()` renders a block again
        self.generic_visit(node)
        _charge_each_pass(node)
        return node


def _charge_each_pass(
    scope: nodes.For | nodes.Macro | nodes.CallBlock | nodes.Block | nodes.Template,
) -> None:
    chars = nodes.Const(_literal_chars(scope.body), lineno=scope.lineno)
    scope.body.insert(0, nodes.ExprStmt(_filter_node(chars, _CHARGE), lineno=scope.lineno))


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        _Instrument().visit(node)
        _charge_each_pass(node)
        super().visit_Template(node, frame)


def _finalize(value: Any) -> Any:
    """Every `{{ expression }}`'s value, before Jinja writes `str(value)`: counted as written."""
    if not isinstance(value, str):
        need_text(value, "printing a value")
        value = str(value)
    budget = _BUDGET.get()
    if budget is not None:
        budget.write(len(value))
        budget.step(len(value) // CHARS_PER_STEP)
    return value


# --- filters: counted, and checked where their result can outgrow their input -----------------


_CONTEXT_NAMES = ("eval_ctx", "context", "environment", "env")


def _bound_filter(
    func: Callable[..., Any], check: Callable[[dict[str, Any]], None] | None
) -> Callable[..., Any]:
    """`func` (a filter or test) counted as a step, its input and result sized; `check` first reads
    its arguments (by parameter name) and may replace them.

    The wrapper takes the template's context, as Jinja's context filters do: Jinja then never runs
    it at compile time to fold a constant (`{{ 'x' | center(1000000) }}` in a loop would otherwise
    become literal text, written on every pass without a check), and it hands `func` the context,
    evaluation context or environment `func` asks for."""
    wanted = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    signature = inspect.signature(func) if check is not None else None  # the function's own
    # Jinja's async variants wrap a function that may not take the context argument they pass on.
    takes_context = signature is not None and next(iter(signature.parameters), "") in _CONTEXT_NAMES

    @functools.wraps(func)
    def bounded(context: Any, *args: Any, **kwargs: Any) -> Any:
        head: tuple[Any, ...] = ()
        if wanted == "context":
            head = (context,)
        elif wanted == "eval_context":
            head = (context.eval_ctx,)
        elif wanted == "environment":
            head = (context.environment,)
        if signature is not None and check is not None:
            bound = signature.bind(*(head if takes_context else ()), *args, **kwargs)
            bound.apply_defaults()
            check(bound.arguments)
            args, kwargs = bound.args[len(head) if takes_context else 0 :], bound.kwargs
        return produced(func(*head, *args, **kwargs), *args)

    return pass_context(bounded)


def _check_join_filter(a: dict[str, Any]) -> None:
    items = _materialize(a["value"], "join")
    if a.get("attribute") is not None:
        getter = make_attrgetter(a["eval_ctx"].environment, a["attribute"])
        items, a["attribute"] = [getter(item) for item in items], None
    _check_join(a["d"], items)
    a["value"] = items


def _check_indent(a: dict[str, Any]) -> None:
    text, width = a["s"], a["width"]
    if isinstance(text, str):
        pad = len(width) if isinstance(width, str) else max(as_int(width) or 0, 0)
        need_chars(len(text) + (text.count("\n") + 1) * pad, "indent")


def _check_center(a: dict[str, Any]) -> None:
    width = as_int(a["width"])
    if width is not None:
        need_chars(width, "center")


def _check_format_filter(a: dict[str, Any]) -> None:
    need_text(a["value"], "format")
    _check_percent(str(a["value"]), a["kwargs"] or tuple(a["args"]))


def _check_wordwrap(a: dict[str, Any]) -> None:
    text, wrap = a["s"], a["wrapstring"]
    if isinstance(text, str) and isinstance(wrap, str):
        need_chars(len(text) + (len(text) + 1) * len(wrap), "wordwrap")


def _check_batch(a: dict[str, Any]) -> None:
    count = as_int(a["linecount"])
    if count is not None:
        need_items(count, "batch")


def _check_slice(a: dict[str, Any]) -> None:
    count = as_int(a["slices"])
    if count is not None:
        need_items(count, "slice")


def _check_list(a: dict[str, Any]) -> None:
    value = a["value"]
    if isinstance(value, str | bytes):
        need_items(len(value), "list")
    elif not isinstance(value, list | tuple | dict | set | frozenset):
        a["value"] = _materialize(value, "list")


def _check_text(key: str, **options: Any) -> Callable[[dict[str, Any]], None]:
    def check(a: dict[str, Any]) -> None:
        need_text(a[key], "converting to text", **options)

    return check


def _check_replace_filter(a: dict[str, Any]) -> None:
    if isinstance(a["s"], str):
        _check_replace(a["s"], a["old"], a["new"], -1 if a["count"] is None else a["count"])


_FILTER_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "join": _check_join_filter,
    "indent": _check_indent,
    "center": _check_center,
    "format": _check_format_filter,
    "wordwrap": _check_wordwrap,
    "batch": _check_batch,
    "slice": _check_slice,
    "list": _check_list,
    "replace": _check_replace_filter,
    "string": _check_text("s"),
    "pprint": _check_text("value", indent=1),
    "xmlattr": _check_text("d"),
    "urlencode": _check_text("value", separator=4),
}


@pass_environment
def _sum(environment: Any, iterable: Iterable[Any], attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's `sum`, with each addition of strings or lists checked and charged like `+`: Python's
    builtin would add a million lists in one call, in quadratic time."""
    items = _materialize(iterable, "sum")
    if attribute is not None:
        getter = make_attrgetter(environment, attribute)
        items = [getter(item) for item in items]
    numbers = (int, float)
    if isinstance(start, numbers) and all(isinstance(item, numbers) for item in items):
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                need_bits(item.bit_length() + len(items).bit_length(), "sum")
        return sum(items, start)  # the same arithmetic as Jinja's filter
    total = start
    for item in items:
        _check_binop("+", total, item)
        total = produced(total + item)
    return total


# --- the sandbox ----------------------------------------------------------------------------------


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every call, arithmetic operation, loop iteration, filter,
    test and output counted and checked against the budget of the render in progress (see the
    module docstring). `filters` are added to Jinja's (and bounded like them)."""

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *, filters: dict[str, Callable[..., Any]] | None = None, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.filters.update({"sum": _sum, **(filters or {})})
        filters_: dict[str, Any] = dict(self.filters)
        self.filters = {
            name: _bound_filter(func, _FILTER_CHECKS.get(name)) for name, func in filters_.items()
        }
        self.filters.update(_INTERNAL_FILTERS)
        tests: dict[str, Any] = dict(self.tests)
        self.tests = {name: _bound_filter(func, None) for name, func in tests.items()}

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(obj, "__self__", None)
        if isinstance(obj, types.BuiltinMethodType) and isinstance(owner, str | bytes | dict):
            args = _check_str_method(obj, args, kwargs)
            _charge(len(owner) // CHARS_PER_STEP)
        return produced(super().call(context, obj, *args, **kwargs), *args)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and isinstance(left, str) and isinstance(right, str):  # the common case, fast
            size = len(left) + len(right)
            need_chars(size, "adding strings")
            budget = _BUDGET.get()
            if budget is not None:
                budget.step(1 + 2 * size // CHARS_PER_STEP)
            return left + right
        _check_binop(operator, left, right)
        return produced(super().call_binop(context, operator, left, right), left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        fmt: str = value.__self__
        is_map = value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            values = [*args, *kwargs.values()]
            if is_map and args and isinstance(args[0], dict):
                values = list(args[0].values())
            _check_brace_format(fmt, values)
            return str(produced(formatter(*args, **kwargs), fmt))

        return checked
