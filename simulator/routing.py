"""How the simulated cluster spreads requests over its ready replicas: round-robin (a Service),
random, least-loaded (fewest requests in flight) or Kvasir's router (its own scorer,
`kvasir.router.scorer.rank`, on prefix affinity, queue and KV usage).

A trace line's `prefix_group` and `prefix_tokens` are what the router can know of its prompt:
the group's leading full blocks are keyed as the real router keys text blocks, and remembered
per replica (`kvasir.router.prefix.PrefixIndex`). Load-aware routings see each replica as of the
arrival (the cluster advances them first); the real router sees a scrape at most one interval
old plus its own count of requests in flight, so this is its best case on staleness."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from kvasir.router.prefix import PrefixIndex
from kvasir.router.scorer import Candidate, Weights, rank
from kvasir.simulator.replica import SimReplica
from kvasir.simulator.trace import TraceRequest

ROUTINGS = ("round-robin", "random", "least-loaded", "kvasir")
# Blocks remembered per replica by the simulated router: as the real router's default.
PREFIX_MEMORY_BLOCKS = 200_000


class Routing(Protocol):
    name: str
    needs_state: bool  # whether replicas must be advanced to the arrival before choosing

    def choose(self, request: TraceRequest, serving: Sequence[SimReplica]) -> SimReplica: ...


class RoundRobin:
    name, needs_state = "round-robin", False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: TraceRequest, serving: Sequence[SimReplica]) -> SimReplica:
        replica = serving[self._turn % len(serving)]
        self._turn += 1
        return replica


class RandomChoice:
    name, needs_state = "random", False

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: TraceRequest, serving: Sequence[SimReplica]) -> SimReplica:
        return self._rng.choice(list(serving))


class LeastLoaded:
    name, needs_state = "least-loaded", True

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: TraceRequest, serving: Sequence[SimReplica]) -> SimReplica:
        return min(serving, key=lambda r: (r.in_flight, self._rng.random()))


class KvasirRouting:
    """The router's scorer over the replicas' exact state at the arrival."""

    name, needs_state = "kvasir", True

    def __init__(self, seed: int, block_size: int, weights: Weights | None = None) -> None:
        self._rng = random.Random(seed)
        self._weights = weights or Weights()
        self._block_size = block_size
        self._prefix = PrefixIndex(PREFIX_MEMORY_BLOCKS)

    def choose(self, request: TraceRequest, serving: Sequence[SimReplica]) -> SimReplica:
        keys = prefix_keys(request, self._block_size)
        by_name = {replica.name: replica for replica in serving}
        candidates = [
            Candidate(
                r.name, float(r.in_flight), r.kv.usage, True, remembered_blocks=self._prefix.size(r.name)
            )
            for r in serving
        ]
        matches = self._prefix.match(keys, by_name) if keys else {}
        choice = rank(candidates, matches, len(keys), self._weights, self._rng)[0]
        if keys:
            self._prefix.record(choice.url, keys)
        return by_name[choice.url]


def prefix_keys(request: TraceRequest, block_size: int) -> list[int]:
    """Keys of the full blocks of the request's shared prefix (none without a group)."""
    if request.prefix_group is None:
        return []
    return [hash((request.prefix_group, index)) for index in range(request.prefix_tokens // block_size)]


def make_routing(name: str, *, seed: int = 0, block_size: int = 16) -> Routing:
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(seed)
    if name == "least-loaded":
        return LeastLoaded(seed)
    if name == "kvasir":
        return KvasirRouting(seed, block_size)
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {name!r}")
