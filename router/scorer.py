"""Choosing a backend: a pure function of what the router knows about each one.

Like llm-d's endpoint picker, each candidate gets a weighted sum of scores in 0..1: prefix affinity
(the share of the prompt's leading blocks it probably holds), queue (min-max normalised over the
candidates: the shortest queue scores 1) and free KV cache. Two rules sit around the sum:
- a backend whose metrics are unknown (its /metrics did not answer) is never taken for idle: it
  ranks after every backend with known metrics, and one that refused a connection after those;
- prefix affinity only counts while it does not overload a backend (SGLang's cache-aware router has
  the same guard): one with more than `balance_ratio` times the least loaded one's requests, and
  `balance_slack` more, loses its prefix score, so a hot prefix spreads instead of piling up.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Weights:
    prefix: float = 3.0
    queue: float = 2.0
    kv: float = 2.0
    lora: float = 2.0
    balance_ratio: float = 1.5
    balance_slack: int = 4


@dataclass(frozen=True)
class Candidate:
    """One backend as the scorer sees it."""

    url: str
    load: float  # requests on it: the router's own in flight, or the scraped running + waiting if more
    kv_usage: float | None  # 0..1; None when unknown
    metrics_known: bool
    reachable: bool = True  # False after a connection to it failed, until a scrape succeeds
    remembered_blocks: int = 0  # prefix blocks the router remembers sending it (its cache's share)
    adapters: frozenset[str] | None = None  # LoRA adapters it serves (/v1/models); None: unknown
    active_adapters: frozenset[str] = frozenset()  # adapters with running or waiting requests
    free_lora_slot: bool | None = None  # fewer active adapters than slots; None: no LoRA info


@dataclass(frozen=True)
class Choice:
    url: str
    reason: str  # prefix, load, unknown_metrics or unreachable: what decided it


def rank(
    candidates: Sequence[Candidate],
    matches: Mapping[str, int],
    num_blocks: int,
    weights: Weights,
    rng: random.Random | None = None,
    adapter: str | None = None,
) -> list[Choice]:
    """Every candidate, best first (the request goes to the first; a retry to the next).
    `adapter`: the LoRA adapter the request asks for (None: the base model, or not known as one)."""
    rng = rng or random.Random()
    if adapter is not None:
        candidates = lora_candidates(candidates, adapter)
    tiers: tuple[list[Candidate], list[Candidate], list[Candidate]] = ([], [], [])
    for candidate in candidates:
        tier = 0 if candidate.reachable and candidate.metrics_known else 1 if candidate.reachable else 2
        tiers[tier].append(candidate)
    ranked: list[Choice] = []
    ranked += _score_tier(tiers[0], matches, num_blocks, weights, rng, adapter)
    # Unknown metrics: by the router's own count of requests in flight only, and named as such.
    for reason, rest in (("unknown_metrics", tiers[1]), ("unreachable", tiers[2])):
        for candidate in sorted(rest, key=lambda c: (c.load, rng.random())):
            ranked.append(Choice(candidate.url, reason))
    return ranked


def _score_tier(
    tier: Sequence[Candidate],
    matches: Mapping[str, int],
    num_blocks: int,
    weights: Weights,
    rng: random.Random,
    adapter: str | None = None,
) -> list[Choice]:
    if not tier:
        return []
    loads = [c.load for c in tier]
    least, most = min(loads), max(loads)
    overloaded = least * weights.balance_ratio
    scored = []
    for candidate in tier:
        queue = 1.0 if most == least else (most - candidate.load) / (most - least)
        kv = 1.0 - candidate.kv_usage if candidate.kv_usage is not None else 0.5
        matched = matches.get(candidate.url, 0)
        prefix = matched / num_blocks if num_blocks else 0.0
        if candidate.load > overloaded and candidate.load > least + weights.balance_slack:
            prefix = 0.0
        score = weights.prefix * prefix + weights.queue * queue + weights.kv * kv
        if adapter is not None:
            score += weights.lora * lora_affinity(candidate, adapter)
        # Ties (idle backends, a prompt no one has seen) go to the backend holding the fewest
        # remembered prefixes, as SGLang's router sends them to its smallest tree: new prefixes
        # spread evenly instead of by chance. Then at random, never always the first.
        scored.append((score, -candidate.remembered_blocks, rng.random(), candidate, prefix > 0))
    scored.sort(key=lambda item: item[:3], reverse=True)
    return [Choice(c.url, "prefix" if by_prefix else "load") for *_, c, by_prefix in scored]


def serves(candidate: Candidate, adapter: str) -> bool | None:
    """Whether a backend serves `adapter`: True, False, or None when it does not say."""
    if adapter in candidate.active_adapters:
        return True
    if candidate.adapters is None:
        return None
    return adapter in candidate.adapters


def lora_candidates(candidates: Sequence[Candidate], adapter: str) -> list[Candidate]:
    """The backends a request for `adapter` may go to: those known to lack it are left out while
    another one serves it (or may: it does not say)."""
    keep = [c for c in candidates if serves(c, adapter) is not False]
    return keep if any(serves(c, adapter) for c in keep) else list(candidates)


def lora_affinity(candidate: Candidate, adapter: str) -> float:
    """The endpoint picker's LoRA affinity: 1 when the adapter has requests running or waiting on
    the backend (it sits in a slot), 0.5 when a slot is free for it, else 0."""
    if adapter in candidate.active_adapters:
        return 1.0
    if candidate.free_lora_slot:
        return 0.5
    return 0.0
