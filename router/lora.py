"""LoRA in the router: weighted aliases (`--lora-aliases`) and what a backend says of its adapters.

An alias names several adapters with integer weights summing to 100 (a rollout: `support` is 90%
`support-v2`, 10% `support-v1`). A request whose `model` is an alias is sent as a request for one
target, drawn by weight, as the Gateway API Inference Extension's InferenceModelRewrite does.

A backend's adapters come from two places: its `/metrics` (`kvasir_lora_requests_info` or
`vllm:lora_requests_info`: the adapters with running and with waiting requests, and `max_lora`)
and its `/v1/models` (every adapter it serves). Scoring follows the endpoint picker's LoRA
affinity (scorer.py)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvasir.observability import metric_names as m

LORA_INFO_NAMES = (m.LORA_INFO.name, "vllm:lora_requests_info")
Aliases = Mapping[str, tuple[tuple[str, int], ...]]


def parse_aliases(text: str) -> dict[str, tuple[tuple[str, int], ...]]:
    """`{"support": {"v2": 90, "v1": 10}}` -> {"support": (("v1", 10), ("v2", 90))}; ValueError
    naming what is wrong (weights are integers from 0 to 100 summing to 100)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("--lora-aliases is not valid JSON") from None
    if not isinstance(value, dict):
        raise ValueError('--lora-aliases must be a JSON object: {"alias": {"adapter": weight, ...}}')
    aliases = {}
    for alias, targets in value.items():
        if not isinstance(targets, dict) or not targets:
            raise ValueError(f"--lora-aliases: {alias!r} must map adapters to weights")
        weights = []
        for adapter, weight in sorted(targets.items()):
            if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
                raise ValueError(f"--lora-aliases: {alias!r}: the weight of {adapter!r} must be 0..100")
            weights.append((str(adapter), weight))
        if sum(weight for _, weight in weights) != 100:
            raise ValueError(f"--lora-aliases: the weights of {alias!r} must sum to 100")
        aliases[str(alias)] = tuple(weights)
    return aliases


def resolve(model: str, aliases: Aliases, rng: random.Random) -> str:
    """The adapter to ask for: `model` itself unless it is an alias, then one target by weight."""
    targets = aliases.get(model)
    if not targets:
        return model
    draw = rng.randrange(100)
    for adapter, weight in targets:
        if draw < weight:
            return adapter
        draw -= weight
    return targets[-1][0]  # unreachable: the weights sum to 100


@dataclass(frozen=True)
class LoraInfo:
    """A backend's adapters with running or waiting requests, and its adapter slots."""

    active: frozenset[str]
    max_lora: int

    @property
    def free_slot(self) -> bool:
        """Fewer adapters running or waiting than slots: one more adapter fits (the picker's
        'available')."""
        return len(self.active) < self.max_lora


_LINES = re.compile(
    rf"^(?:# (?:HELP|TYPE) )?(?:{'|'.join(re.escape(n) for n in LORA_INFO_NAMES)})(?:[{{ \t].*)?$",
    re.MULTILINE,
)


def read_lora_info(text: str) -> LoraInfo | None:
    """The LoRA info series of a /metrics page (the newest, as the picker reads it); None when
    the page has none or the backend serves no adapters (max_lora 0)."""
    wanted = "\n".join(match.group() for match in _LINES.finditer(text))
    if not wanted:
        return None
    best: tuple[float, LoraInfo] | None = None
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            labels = sample.labels
            try:
                slots = int(labels.get("max_lora", "0"))
            except ValueError:
                continue
            names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
            info = LoraInfo(frozenset(name for name in names.split(",") if name), slots)
            if best is None or sample.value >= best[0]:
                best = (sample.value, info)
    if best is None or best[1].max_lora <= 0:
        return None
    return best[1]
