"""The kinds of the spec that are Kvasir's own objects rather than plain values: where the model
comes from, a reference to a Secret key, and the speculative-decoding setup (whose ranges and
methods are the runtime's `--speculative-config`, so the two cannot disagree)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvasir.operator.api import validation
from kvasir.operator.api.declare import Section, camel_case, spec_field
from kvasir.operator.api.kinds import DNS_1123_SUBDOMAIN, Integer, Kind, Number, Schema, String
from kvasir.operator.api.source import ModelSource, SpecError, parse_model_source
from kvasir.runtime.spec_decode.config import (
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    parse_speculative_config,
)


@dataclass(frozen=True)
class ModelSourceString(Kind):
    """spec.model.source: hf://, pvc:// or an absolute path (its format is a CEL rule too)."""

    max_length: int = 512

    def schema(self) -> Schema:
        return {"type": "string", "maxLength": self.max_length}

    def parse(self, value: Any, path: str) -> ModelSource:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, got {value!r}")
        if len(value) > self.max_length:
            raise SpecError(path, f"must be at most {self.max_length} characters, got {len(value)}")
        return parse_model_source(value, path)


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class SecretRef(Kind):
    """A key of a Secret in the LLMDeployment's namespace; `default_key` when the key is unset."""

    default_key: str

    def schema(self) -> Schema:
        return {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 253,
                    "pattern": DNS_1123_SUBDOMAIN,
                    "description": "The Secret's name, in the LLMDeployment's namespace.",
                },
                "key": {
                    "type": "string",
                    "default": self.default_key,
                    "maxLength": 253,
                    "description": "The key inside the Secret.",
                },
            },
        }

    def parse(self, value: Any, path: str) -> SecretKeyRef:
        if not isinstance(value, Mapping):
            raise SpecError(path, "must be an object with the Secret's name (and key)")
        if not value.get("name"):
            raise SpecError(f"{path}.name", "the Secret's name is required")
        name = validation.dns_1123_subdomain(value.get("name"), f"{path}.name")
        key = value.get("key") or self.default_key
        if not isinstance(key, str) or not key:
            raise SpecError(f"{path}.key", "must be a non-empty string")
        if len(key) > 253:
            raise SpecError(f"{path}.key", "must be at most 253 characters")
        return SecretKeyRef(name=name, key=key)


@dataclass(frozen=True)
class SpeculativeDecoding:
    """spec.runtime.speculativeDecoding as the CRD declares it; read into the runtime's own
    `SpeculativeConfig`, whose parser states the rules between the fields."""

    method: str = spec_field(
        String(enum=SPECULATIVE_METHODS),
        "ngram looks the drafts up in the request's own tokens (prompt lookup); draft_model runs a "
        "smaller model that shares the tokenizer; layer_skip runs the model's first numLayers layers "
        "as its own draft.",
    )
    num_speculative_tokens: int = spec_field(
        Integer(1, MAX_SPECULATIVE_TOKENS), "Tokens drafted per step for each request."
    )
    prompt_lookup_max: int | None = spec_field(
        Integer(1, MAX_PROMPT_LOOKUP),
        "ngram only; the longest suffix n-gram searched for (default 5, or promptLookupMin).",
        default=None,
    )
    prompt_lookup_min: int | None = spec_field(
        Integer(1, MAX_PROMPT_LOOKUP),
        "ngram only; the shortest suffix n-gram searched for (default 5, or promptLookupMax).",
        default=None,
    )
    model: str | None = spec_field(
        String(min_length=1, max_length=1024),
        "draft_model only (and required there); a hub id (org/name) or a path inside the pod, e.g. "
        "/models/<dir> on the model's claim.",
        default=None,
    )
    num_layers: int | None = spec_field(
        Integer(1, 1 << 16),
        "layer_skip only (and required there); how many of the model's first layers draft, fewer "
        "than it has.",
        default=None,
    )
    # Its upper bound is exclusive, which OpenAPI cannot say without exclusiveMaximum; the CEL
    # overlay states it, and the runtime's parser checks it.
    min_acceptance_rate: float | None = spec_field(
        Number(),
        "Below this share of accepted drafts a request stops speculating for a while (default 0.2); "
        "at least 0 and less than 1.",
        default=None,
    )


class Speculative(Section):
    """The section's fields are read as declared, then the runtime's parser checks the whole."""

    def __init__(self) -> None:
        super().__init__(SpeculativeDecoding)

    def parse(self, value: Any, path: str) -> SpeculativeConfig:
        declared = super().parse(value, path)
        try:
            return parse_speculative_config({k: v for k, v in asdict(declared).items() if v is not None})
        except ValueError as exc:
            # The runtime names `speculative_config.<field>`; the CRD's user wrote `<path>.<fieldName>`.
            match = re.match(r"speculative_config\.(\w+) (.*)", str(exc), re.DOTALL)
            if match is None:
                raise SpecError(path, str(exc).removeprefix("speculative_config ")) from None
            raise SpecError(f"{path}.{camel_case(match[1])}", match[2]) from None
