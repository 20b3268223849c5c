"""`--speculative-config`: which drafter proposes tokens and how many, in vLLM's JSON shape.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4}
    {"method": "layer_skip", "num_layers": 8, "num_speculative_tokens": 3}

Torch-free, so the operator and the flag parser can validate a config without loading a model.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, fields
from typing import Any, Literal

SpeculativeMethod = Literal["ngram", "draft_model", "layer_skip"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = ("ngram", "draft_model", "layer_skip")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's default n-gram length when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
MAX_PROMPT_LOOKUP = 64


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200


def _shown(value: Any) -> str:
    """A value in an error message, cut short (a bad value may be a megabyte of nested lists)."""
    return _REPR.repr(value)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """A validated speculative-decoding setup; construct with `parse_speculative_config`."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    # ngram (prompt lookup): the longest and shortest suffix n-gram searched for in the context.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: a smaller model that shares the target's tokenizer.
    model: str | None = None
    # layer_skip: the target's first `num_layers` layers and its LM head are the draft.
    num_layers: int | None = None
    # Below this mean acceptance (accepted / drafted, over a recent window) a request stops
    # speculating for a while: drafts nobody accepts only cost verification work.
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {_shown(self.method)}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(
                f"speculative_config.min_acceptance_rate must be in [0, 1), got {_shown(self.min_acceptance_rate)}"
            )
        allowed = {
            "ngram": {"prompt_lookup_max", "prompt_lookup_min"},
            "draft_model": {"model"},
            "layer_skip": {"num_layers"},
        }[self.method]
        for name in ("prompt_lookup_max", "prompt_lookup_min", "model", "num_layers"):
            if name not in allowed and getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} does not apply to method {_shown(self.method)}")
        if self.method == "ngram":
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                value = getattr(self, name)
                if value is not None:
                    _check_int(name, value, 1, MAX_PROMPT_LOOKUP)
            if (
                self.prompt_lookup_max is not None
                and self.prompt_lookup_min is not None
                and self.prompt_lookup_min > self.prompt_lookup_max
            ):
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                    f"prompt_lookup_max ({self.prompt_lookup_max})"
                )
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                "speculative_config.model is required for method 'draft_model' (a path or hub id)"
            )
        if self.method == "layer_skip":
            if self.num_layers is None:
                raise ValueError("speculative_config.num_layers is required for method 'layer_skip'")
            _check_int("num_layers", self.num_layers, 1, 1 << 16)

    @property
    def ngram_range(self) -> tuple[int, int]:
        """(shortest, longest) n-gram for prompt lookup; one bound alone stands for both (vLLM)."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
        return (low if low is not None else high), (high if high is not None else low)  # type: ignore[return-value]

    def to_json(self) -> str:
        """The compact JSON a pod's `--speculative-config` receives (unset fields left out)."""
        items = {f.name: getattr(self, f.name) for f in fields(self)}
        items = {
            k: v for k, v in items.items() if v is not None and not (k == "min_acceptance_rate" and v == 0.2)
        }
        return json.dumps(items, separators=(",", ":"))


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(
            f"speculative_config.{name} must be an integer in [{low}, {high}], got {_shown(value)}"
        )


def parse_speculative_config(value: str | dict[str, Any]) -> SpeculativeConfig:
    """Parse the flag's JSON (or an already-decoded object); ValueError names the field at fault."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError("speculative_config is nested too deeply to be read") from None
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be a JSON object")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown field(s): {', '.join(unknown)[:300]}")
    if "method" not in value:
        raise ValueError("speculative_config.method is required (ngram, draft_model or layer_skip)")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required")
    rate = value.get("min_acceptance_rate", 0.2)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise ValueError(f"speculative_config.min_acceptance_rate must be a number, got {_shown(rate)}")
    return SpeculativeConfig(**{**value, "min_acceptance_rate": float(rate)})
