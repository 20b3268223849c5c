"""Routing in the simulator: the four routings, and what Kvasir's scorer does on a trace whose
requests share system prompts (more prefix-cache hits, lower TTFT, on the same replicas)."""

from __future__ import annotations

import pytest

from kvasir.simulator.cluster import ClusterConfig, simulate
from kvasir.simulator.policies import Static
from kvasir.simulator.profile import ReplicaProfile, StepModel
from kvasir.simulator.routing import ROUTINGS, make_routing, prefix_keys
from kvasir.simulator.trace import TraceRequest, generate

# Room for a few groups' prefixes per replica, not for all of them: where they land matters.
PROFILE = ReplicaProfile(
    name="routing",
    description="a replica whose cache holds a handful of system prompts",
    step=StepModel(base_s=0.005, per_token_s=0.0002, per_kv_token_s=0.000001, per_seq_s=0.0005),
    num_kv_blocks=400,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=1024,
    max_model_len=2048,
    cold_start_s=30.0,
)


def _trace() -> list[TraceRequest]:
    return generate("poisson", duration=60, rate=3, seed=3, prefix_groups=12, prefix_tokens=800)


def _run(routing: str) -> dict[str, float]:
    config = ClusterConfig(PROFILE, min_replicas=3, max_replicas=3)
    trace = _trace()
    result = simulate(trace, config, Static(3), initial_replicas=3, routing=make_routing(routing, seed=1))
    assert len(result.finished) == len(trace)
    return result.summary()


def test_every_routing_serves_the_whole_trace() -> None:
    for routing in ROUTINGS:
        assert _run(routing)["routing"] == routing


def test_the_scorer_finds_the_cached_prefixes_round_robin_misses() -> None:
    round_robin, kvasir = _run("round-robin"), _run("kvasir")
    assert kvasir["cached_token_fraction"] > 1.4 * round_robin["cached_token_fraction"]
    assert kvasir["ttft_p50_s"] < 0.5 * round_robin["ttft_p50_s"]
    assert kvasir["ttft_p99_s"] < round_robin["ttft_p99_s"]


def test_round_robin_is_the_default_and_unchanged() -> None:
    config = ClusterConfig(PROFILE, min_replicas=3, max_replicas=3)
    trace = _trace()
    default = simulate(trace, config, Static(3), initial_replicas=3).summary()
    assert default == _run("round-robin")


def test_prefix_keys_cover_the_groups_full_blocks_only() -> None:
    request = TraceRequest(0.0, 100, 5, "g1", 40)
    assert len(prefix_keys(request, 16)) == 2
    assert prefix_keys(request, 16) == prefix_keys(TraceRequest(1.0, 90, 1, "g1", 40), 16)
    assert prefix_keys(TraceRequest(0.0, 100, 5), 16) == []
    with pytest.raises(ValueError, match="routing must be one of"):
        make_routing("sticky")
