"""The tensor-parallel profiles (H100, TP=2/4/8): derived from the roofline and the all-reduce's
bytes, shipped as derived, and counted as N GPUs a replica."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvasir.simulator.cluster import ClusterConfig, simulate
from kvasir.simulator.policies import Static
from kvasir.simulator.profile import load_profile, shipped_profiles
from kvasir.simulator.roofline import (
    H100,
    LLAMA3_8B,
    LLAMA3_70B,
    SHIPPED,
    allreduce_seconds,
    derive_profile,
    main,
    stale_profiles,
)
from kvasir.simulator.trace import Lengths, generate

SOURCE_PROFILES = Path(__file__).resolve().parents[2] / "simulator" / "profiles"
MODELS = ["llama3-8b", "llama3-70b"]


def _name(model: str, tp: int) -> str:
    return f"h100-{model}" + (f"-tp{tp}" if tp > 1 else "")


def test_the_tp_profiles_ship_load_and_are_what_the_method_derives() -> None:
    names = {_name(model, tp) for model in MODELS for tp in (2, 4, 8)}
    assert names <= set(shipped_profiles())
    for name in names:
        profile = load_profile(name)
        assert profile.name == name and profile.gpus == int(name.rsplit("tp", 1)[1])
        assert "not measured" in profile.description
    assert stale_profiles(SOURCE_PROFILES) == []  # python -m kvasir.simulator.roofline --write DIR
    assert len(SHIPPED) == len(names)


def test_the_method_at_tp1_agrees_with_the_shipped_8b_profile() -> None:
    """The same roofline that made h100-llama3-8b (it rounded the weights to 16.1 GB and the
    FLOPs to 16 G a token; the shapes give 16.06)."""
    shipped, derived = load_profile("h100-llama3-8b"), derive_profile(LLAMA3_8B, H100, 1)
    for field in ("base_s", "per_token_s", "per_kv_token_s", "per_seq_s", "weights_s"):
        assert getattr(derived.step, field) == pytest.approx(getattr(shipped.step, field), rel=0.005), field
    assert derived.num_kv_blocks == pytest.approx(shipped.num_kv_blocks, rel=0.005)
    assert derived.cold_start_s == shipped.cold_start_s
    assert derived.step.allreduce_time(8192) == 0.0
    assert LLAMA3_70B.weight_bytes == pytest.approx(141.1e9, rel=0.001)  # Llama-3-70B's 70.6 B in bf16


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("batch", "context"), [(1, 1000), (32, 32 * 1000), (256, 256 * 500), (8192, 0)])
def test_step_time_falls_with_n_but_less_than_linearly(model: str, batch: int, context: int) -> None:
    """Decode (batch 1 to 256) and a full prefill step: each doubling of N is faster, never twice
    as fast, and the all-reduce takes a growing share of the step."""
    tps = (1, 2, 4, 8) if model == "llama3-8b" else (2, 4, 8)
    seqs = 1 if batch == 8192 else batch
    steps, shares = [], []
    for tp in tps:
        step = load_profile(_name(model, tp)).step
        steps.append(step.step_time(batch, context, seqs))
        shares.append(step.allreduce_time(batch) / steps[-1])
    for i in range(len(tps) - 1):
        (n0, t0), (n1, t1) = (tps[i], steps[i]), (tps[i + 1], steps[i + 1])
        assert t1 < t0, (n0, n1)
        assert t1 > t0 * n0 / n1, (n0, n1)  # less than linear: the speed-up is below n1 / n0
    assert shares == sorted(shares) and shares[0] < shares[-1]
    assert shares[-1] > 0.1  # at TP=8 the all-reduces are a tenth of the step or more


def test_the_all_reduce_is_the_ring_formula() -> None:
    assert allreduce_seconds(1e6, 1, H100) == 0.0
    assert allreduce_seconds(1e6, 4, H100) == pytest.approx(2 * 3 / 4 * 1e6 / 450e9 + 10e-6)
    step = load_profile("h100-llama3-70b-tp8").step
    one = allreduce_seconds(64 * 8192 * 2, 8, H100)  # batch 64 x hidden 8192 x 2 bytes
    assert step.allreduce_time(64) == pytest.approx(2 * 80 * one)  # two a layer, 80 layers


@pytest.mark.parametrize("model", MODELS)
def test_kv_capacity_grows_with_n(model: str) -> None:
    blocks = [load_profile(_name(model, tp)).num_kv_blocks for tp in (2, 4, 8)]
    assert blocks == sorted(blocks) and len(set(blocks)) == 3
    # More than N times: each GPU holds 1/N of a token's KV, and 1/N of the weights frees memory.
    assert blocks[1] > 2 * blocks[0] and blocks[2] > 2 * blocks[1]


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    """With 4 KV heads at TP=8 each rank still holds a whole head: a token's KV per GPU stops
    shrinking past N=4, so capacity grows only by the memory the smaller weight shard frees."""
    narrow = replace(LLAMA3_8B, key="narrow", name="Narrow-8B", kv_heads=4)
    assert [narrow.kv_bytes_per_token(tp) for tp in (1, 2, 4, 8)] == [
        32 * 2 * heads * 128 * 2 for heads in (4, 2, 1, 1)
    ]
    tp4, tp8 = derive_profile(narrow, H100, 4), derive_profile(narrow, H100, 8)
    assert tp4.num_kv_blocks < tp8.num_kv_blocks < 1.1 * tp4.num_kv_blocks
    assert "replicated" in tp8.description and "replicated" not in tp4.description


def test_a_70b_model_on_one_h100_is_refused() -> None:
    with pytest.raises(ValueError) as refused:
        derive_profile(LLAMA3_70B, H100, 1)
    message = str(refused.value)
    assert "Llama-3-70B at tensor-parallel size 1 on H100 SXM: the weights do not fit" in message
    assert "141.1 GB" in message and "80 GB" in message and "the smallest size that fits is 2" in message
    assert "h100-llama3-70b" not in shipped_profiles()
    with pytest.raises(ValueError, match="must divide the 64 attention heads"):
        derive_profile(LLAMA3_70B, H100, 3)
    with pytest.raises(ValueError, match="1 to 8"):
        derive_profile(LLAMA3_70B, H100, 16)


def test_the_derivation_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["llama3-70b", "--tp", "1"]) == 2
    assert "the weights do not fit" in capsys.readouterr().err
    assert main(["llama3-70b", "--tp", "4"]) == 0
    assert '"name": "h100-llama3-70b-tp4"' in capsys.readouterr().out
    done = subprocess.run(
        [sys.executable, "-m", "kvasir.simulator.roofline", "--check", str(SOURCE_PROFILES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_gpu_hours_count_n_gpus_a_replica() -> None:
    """A TP=4 replica costs 4 GPU-hours an hour: two of them for half an hour are 4 GPU-hours."""
    trace = generate("poisson", duration=1800, rate=0.2, seed=1, lengths=Lengths(256, 64))
    for tp in (2, 4, 8):
        profile = load_profile(_name("llama3-70b", tp))
        config = ClusterConfig(profile, min_replicas=2, max_replicas=2, interval_s=15, cold_start_s=30)
        result = simulate(trace, config, Static(2), initial_replicas=2)
        assert len(result.finished) == len(trace)
        assert result.gpu_hours == pytest.approx(2 * tp * 1800 / 3600, rel=0.02), tp
