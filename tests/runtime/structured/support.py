"""Shared helpers for the structured-output tests: tiny engines, independent checks of outputs.

The references here do not come from the grammar engine: JSON is parsed by `json` and validated
by `jsonschema` (Draft 2020-12, formats checked), regexes by Python's `re`, and whitespace is
found by a small JSON scanner. Only the prefix check of a cut output asks the grammar engine,
through a fresh state of the request's compiled grammar.
"""

from __future__ import annotations

import calendar
import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.structured.params import StructuredOutputs

MAX_MODEL_LEN = 256
JSON_WHITESPACE = " \t\n\r"


def engine(path: Path, **overrides: Any) -> LLMEngine:
    """The tiny random model on the CPU, float32 (deterministic greedy), a 256-token context."""
    values: dict[str, Any] = {
        "model": str(path),
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        **overrides,
    }
    return LLMEngine(EngineConfig(**values))


def json_spec(schema: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs.json_schema(schema, "structured_outputs.json")


# ---- formats: jsonschema's own checkers (email, ipv4, ipv6, uuid), RFC 3339 dates and times ----

_TIME = re.compile(r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))")


def _rfc3339_time(text: str) -> bool:
    match = _TIME.fullmatch(text)
    if match is None:
        return False
    hour, minute, second = (int(match.group(i)) for i in (1, 2, 3))
    if match.group(6) is not None and (int(match.group(6)) > 23 or int(match.group(7)) > 59):
        return False
    return hour <= 23 and minute <= 59 and second <= 60  # 60: a leap second


def _rfc3339_full_date(text: str) -> bool:
    """RFC 3339 full-date: 4-digit year (0000 included, unlike Python's `date`), a month, and a
    day that exists in that month of that year (February 29 only in leap years)."""
    match = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", text)
    if match is None:
        return False
    year, month, day = (int(part) for part in match.groups())
    if not 1 <= month <= 12:
        return False
    days = calendar.monthrange(year or 2000, month)[1]  # year 0 is a leap year, as 2000
    return 1 <= day <= days


def _rfc3339_date_time(text: str) -> bool:
    date, sep, time = text.partition("T") if "T" in text else text.partition("t")
    return bool(sep) and _rfc3339_full_date(date) and _rfc3339_time(time)


FORMATS = FormatChecker()
for _name, _check in Draft202012Validator.FORMAT_CHECKER.checkers.items():
    FORMATS.checkers[_name] = _check
FORMATS.checks("date")(lambda instance: not isinstance(instance, str) or _rfc3339_full_date(instance))
FORMATS.checks("time")(lambda instance: not isinstance(instance, str) or _rfc3339_time(instance))
FORMATS.checks("date-time")(lambda instance: not isinstance(instance, str) or _rfc3339_date_time(instance))
# Formats whose checks come with jsonschema or are defined above; a schema under test may use these.
CHECKED_FORMATS = ("date", "time", "date-time", "email", "ipv4", "ipv6", "uuid")
assert all(name in FORMATS.checkers for name in CHECKED_FORMATS)


@functools.lru_cache(maxsize=1024)
def _validator(schema_text: str) -> Draft202012Validator:
    schema = json.loads(schema_text)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=FORMATS)


def validator(schema: dict[str, Any]) -> Draft202012Validator:
    """A Draft 2020-12 validator that checks formats (the schema itself checked first)."""
    return _validator(json.dumps(schema, sort_keys=True))


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator(schema).iter_errors(instance)]


# ---- outputs --------------------------------------------------------------------------------


def output_ids(choice: Completion, eos_token_ids: Sequence[int]) -> list[int]:
    """The choice's tokens without a final EOS (which ends the output; it is not part of it)."""
    ids = list(choice.token_ids)
    if choice.finish_reason == "stop" and ids and ids[-1] in eos_token_ids:
        ids.pop()
    return ids


def refused_at(llm: LLMEngine, spec: StructuredOutputs, token_ids: Sequence[int]) -> int | None:
    """Where a fresh state of the spec's grammar refuses `token_ids` (None: it accepts them all)."""
    state = llm.grammars.compile(spec).new_state()
    accepted = state.valid_prefix(list(token_ids))
    return None if accepted == len(token_ids) else accepted


def whitespace_runs(text: str) -> list[str]:
    """The runs of whitespace in JSON text outside its string literals (raises on a bad string)."""
    runs: list[str] = []
    i, current = 0, ""
    while i < len(text):
        char = text[i]
        if char == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            if current:
                runs.append(current)
                current = ""
            continue
        if char in JSON_WHITESPACE:
            current += char
        elif current:
            runs.append(current)
            current = ""
        i += 1
    if current:
        runs.append(current)
    return runs


def parse_json(text: str) -> Any:
    """json.loads, but failing on what Python accepts and JSON does not (NaN, Infinity)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def output_errors(llm: LLMEngine, spec: StructuredOutputs, choice: Completion) -> list[str]:
    """What is wrong with a choice generated under `spec`, checked by the independent references:
    a complete ("stop") output must be in the language (jsonschema for json, `re.fullmatch` for a
    regex, membership for a choice, a JSON object for json_object); any output, complete or cut,
    must be a sequence of tokens the grammar accepts."""
    eos = llm.tokenizer.eos_token_ids or llm.model_config.eos_token_ids
    errors = []
    refused = refused_at(llm, spec, output_ids(choice, eos))
    if refused is not None:
        errors.append(f"the grammar refuses token {refused} of {choice.text!r}")
    if choice.finish_reason == "length":
        return errors
    if choice.finish_reason != "stop":
        return [*errors, f"finished by {choice.finish_reason!r}"]
    text = choice.text
    if spec.kind in ("json", "json_object"):
        try:
            value = parse_json(text)
        except ValueError as error:
            return [*errors, f"not JSON ({error}): {text!r}"]
        if spec.kind == "json":
            errors += schema_errors(json.loads(spec.value), value)
        elif not isinstance(value, dict):
            errors.append(f"not an object: {text!r}")
    elif spec.kind == "regex":
        if re.fullmatch(spec.value, text) is None:
            errors.append(f"{text!r} does not match {spec.value!r}")
    elif spec.kind == "choice" and text not in json.loads(spec.value):
        errors.append(f"{text!r} is not one of {spec.value}")
    return errors
