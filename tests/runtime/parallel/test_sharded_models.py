"""Tensor parallelism on tiny random Llama, Qwen2 and Qwen3 checkpoints: two gloo ranks against one.

The two ranks run in spawned processes (`sharded_ranks`), the size-1 baseline in this one. Per
model: the logits over a paged KV cache agree with size 1 within 1e-4 (float32) and are the same
bits on both ranks and in a second pass; greedy tokens through `ModelRunner` equal size 1's; the
sampled token tensor is the same on both ranks; both ranks agree on the KV blocks (rank 0 offers
the smaller budget); the KV cache holds each rank's KV heads; each rank's weights are about half.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvasir.runtime.layers.tensor_parallel import RowParallelLinear, VocabParallelEmbedding
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.models.registry import get_model_class
from kvasir.runtime.parallel.group import SINGLE, TensorParallel
from tests.lora_adapters import make_peft_adapter
from tests.runtime.parallel.sharded_ranks import Job, load, run_job, run_ranks

ATOL = 1e-4
PROMPTS = ((5, 9, 17, 33, 60), tuple(range(40, 53)), (7, 7, 8, 100, 200, 300, 4))

# name -> (family, config overrides, KV heads per rank at size 2)
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    # Biases on o_proj and down_proj (added once, after the all-reduce); a vocabulary of 387 rows
    # does not split in two (rank 1 holds 193, its logits padded before the gather).
    "llama-bias-odd-vocab": ("llama", {"attention_bias": True, "mlp_bias": True, "vocab_size": 387}, 2),
    "qwen2": ("qwen2", {}, 1),  # tied embeddings, q/k/v biases, 2 KV heads
    "qwen3": ("qwen3", {}, 1),  # q/k norms, head_dim 32 != hidden / heads
    # One KV head for two ranks: replicated, each rank computes it.
    "llama-one-kv-head": ("llama-gqa-llama3-rope", {}, 1),
}

# Speculative decoding at size 2 (on plain tiny Llama): the drafts of the target's first layer
# (layer_skip: its collectives run on every rank), and of a draft model held whole by every rank.
SPECULATIVE: dict[str, dict[str, Any]] = {
    "layer-skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2},
    "draft-model": {"method": "draft_model", "num_speculative_tokens": 2},
}


@pytest.fixture(scope="module")
def runs(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """name -> (the size-1 results, [rank 0's, rank 1's] at size 2)."""
    jobs = [
        Job(name, str(tiny_checkpoint(family, **overrides)), PROMPTS)
        for name, (family, overrides, _) in MODELS.items()
    ]
    llama = str(tiny_checkpoint("llama"))
    for name, spec in SPECULATIVE.items():
        spec = {**spec, "model": llama} if spec["method"] == "draft_model" else spec
        jobs.append(Job(name, llama, PROMPTS, decode_steps=6, speculative=spec))
    # LoRA on every projection; requests 0 and 2 run the adapter, 1 and 3 (the same prompts) not.
    adapter = make_peft_adapter(Path(llama), tmp_path_factory.mktemp("adapter"), rank=4)
    jobs.append(Job("lora", llama, (PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]), lora=str(adapter)))
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(2, jobs, out)
    return {job.name: (run_job(job, SINGLE), [load(out, job.name, rank) for rank in (0, 1)]) for job in jobs}


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_size_one_and_are_the_same_bits_on_every_rank(runs: dict[str, Any], name: str) -> None:
    single, ranks = runs[name]
    for step, expected in enumerate(single["logits"]):
        torch.testing.assert_close(ranks[0]["logits"][step], expected, atol=ATOL, rtol=0)
        assert torch.equal(ranks[0]["logits"][step], ranks[1]["logits"][step]), f"step {step}"


@pytest.mark.parametrize("name", list(MODELS))
def test_runs_are_bitwise_reproducible(runs: dict[str, Any], name: str) -> None:
    _, ranks = runs[name]
    for rank in ranks:
        for first, again in zip(rank["logits"], rank["logits_again"], strict=True):
            assert torch.equal(first, again)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_through_the_model_runner_equal_size_one(runs: dict[str, Any], name: str) -> None:
    single, ranks = runs[name]
    assert ranks[0]["tokens"] == single["tokens"]
    assert ranks[1]["tokens"] == single["tokens"]
    assert len(ranks[0]["token_tensors"]) == len(ranks[1]["token_tensors"]) > 0
    for ours, theirs in zip(ranks[0]["token_tensors"], ranks[1]["token_tensors"], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", list(MODELS))
def test_kv_cache_holds_this_ranks_heads_in_the_blocks_rank_zero_can_hold(
    runs: dict[str, Any], name: str
) -> None:
    _, ranks = runs[name]
    kv_heads = MODELS[name][2]
    for rank in ranks:
        assert rank["kv_cache_shape"][2] == kv_heads
    # Rank 1 offered twice rank 0's bytes: both hold what rank 0's budget buys.
    assert ranks[1]["kv_bytes"] == 2 * ranks[0]["kv_bytes"]
    # The ranks share the machine's KV budget by what a token takes on each (here halves).
    assert [rank["kv_share"] for rank in ranks] == [0.5, 0.5]
    expected = int(ranks[0]["kv_bytes"] * ranks[0]["kv_share"]) // ranks[0]["kv_block_bytes"]
    assert ranks[0]["num_blocks"] == ranks[1]["num_blocks"] == expected


@pytest.mark.parametrize("name", list(SPECULATIVE))
def test_speculative_decoding_verifies_drafts_and_keeps_the_greedy_tokens(
    runs: dict[str, Any], name: str
) -> None:
    single, ranks = runs[name]
    assert ranks[0]["num_draft_tokens"] == single["num_draft_tokens"] > 0
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == single["tokens"]


@pytest.mark.parametrize("name", ["llama-bias-odd-vocab", "qwen2", "qwen3"])
def test_each_rank_holds_about_half_the_weights(runs: dict[str, Any], name: str) -> None:
    single, ranks = runs[name]
    for rank in ranks:
        # Norms (and o/down biases) are held whole by every rank: a little over half.
        assert 0.5 <= rank["weight_bytes"] / single["weight_bytes"] < 0.53


def test_a_size_the_heads_or_the_mlp_cannot_split_is_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    config = open_model(str(tiny_checkpoint("llama"))).config  # 4 heads, 4 KV heads, MLP of 128
    model_class = get_model_class(config.architecture)
    # 3 ranks take the KV heads 1, 1 and 2 (with their query heads), but 128 does not split in 3.
    with pytest.raises(
        ValueError, match=r"the MLP's intermediate_size \(128\) is not divisible by --tensor-parallel-size 3"
    ):
        model_class(config, TensorParallel(rank=0, size=3))
    # 6 ranks would replicate the 4 KV heads, which needs a multiple of 4.
    with pytest.raises(
        ValueError,
        match=r"--tensor-parallel-size 6 must be a multiple of the number of key/value heads \(4\)",
    ):
        model_class(config, TensorParallel(rank=0, size=6))


def test_lora_adapters_run_sharded_with_the_tokens_of_size_one(runs: dict[str, Any]) -> None:
    single, ranks = runs["lora"]
    tokens = single["tokens"]
    # The adapter changes the output (requests 0 and 1 share a prompt; only 0 runs the adapter).
    assert tokens["r0"] != tokens["r1"] and tokens["r2"] != tokens["r3"]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == tokens


def test_size_one_builds_layers_that_never_communicate(tiny_checkpoint: Callable[..., Path]) -> None:
    """At size 1 nothing communicates and nothing is sharded (no process group exists in this
    test): o_proj and down_proj are row-parallel layers of the one rank (so they sum their product
    as N ranks do; their all-reduce is a no-op), the embedding is the plain one."""
    config = open_model(str(tiny_checkpoint("llama", attention_bias=True, mlp_bias=True))).config
    model = get_model_class(config.architecture)(config, SINGLE)
    assert not any(isinstance(module, VocabParallelEmbedding) for module in model.modules())
    row_parallel = [module for module in model.modules() if isinstance(module, RowParallelLinear)]
    assert len(row_parallel) == 2 * config.num_hidden_layers
    assert all(module.parallel is SINGLE for module in row_parallel)
    assert model.weight_shards() == {}
