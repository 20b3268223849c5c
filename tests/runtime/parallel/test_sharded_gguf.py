"""Tensor parallelism on the embedded GGUF (SmolLM2-135M, Q4_1, kept packed on every rank).

SmolLM2-135M has 9 attention heads and 3 KV heads, which two ranks split by whole KV heads and
their query groups: rank 0 takes 1 KV head and 3 query heads, rank 1 takes 2 and 6
(`partition.head_shard`); the MLP and the vocabulary split in halves. o_proj's inputs split at 192
of 576 and down_proj's at 768 of 1536, on Q4_1's 32-value blocks, so every shard stays packed. Two
spawned gloo ranks against one: the logits agree within 1e-4 and are the same bits on every rank
and in a second pass, greedy tokens through `ModelRunner` are equal, each rank holds about half the
packed weights, and loading raises its peak resident memory by well under the whole model's.

The comparison is in float32 arithmetic, as the issue asks: the packed kernels run with float
activations (`KVASIR_GGUF_CPU_ACTIVATIONS=float`), both sizes on the fused C decoder stack (each
rank its shard of it, all-reducing after o and down), and again both layer by layer
(`KVASIR_CPU_DECODER_STACK=0`). o_proj and down_proj sum their partial products in float64 at
every size and round once (layers/tensor_parallel.py), so a rank's third or two thirds of the sum
plus an all-reduce gives one process's bits: the logits are within 1e-4 (measured: equal). With
the kernels' defaults (activations rounded to 16 bits per block, the stack at both sizes) the
logits are held to 1e-4 too, and the greedy tokens of a few prompts are equal.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvasir.runtime.layers.quantization.gguf import ACTIVATIONS_ENV
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.models.cpu_decoder_stack import DISABLE_ENV
from kvasir.runtime.models.registry import get_model_class
from kvasir.runtime.parallel.group import SINGLE, TensorParallel
from kvasir.runtime.parallel.partition import head_shard
from tests.runtime.parallel.sharded_ranks import Job, load, run_job, run_ranks

# The issue's bound. Summed in float32, the ranks' partial products of o_proj and down_proj ended
# in other last bits than one process's running sum, and 30 layers made that up to 1.07e-4.
ATOL = 1e-4
SIZE = 2
# Token ids of SmolLM2's vocabulary (49152), not text: the model's own chat is tested elsewhere.
PROMPTS = ((1, 504, 3, 9000, 42, 7, 2830), (17, 1230, 5000))


def job(runner: bool = True) -> Job:
    return Job(
        "smollm2", str(embedded_model_path()), PROMPTS, decode_steps=3, kv_bytes=8 << 20, runner=runner
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Size 1 and 2 on the fused C decoder stack (the default), float activations."""
    out = tmp_path_factory.mktemp("ranks")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ACTIVATIONS_ENV, "float")  # the spawned ranks inherit it
        run_ranks(SIZE, [job()], out)
        single = run_job(job(), SINGLE)
    return single, [load(out, "smollm2", rank) for rank in range(SIZE)]


@pytest.fixture(scope="module")
def layer_by_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The same with the stack off: each layer's kernels called from Python."""
    out = tmp_path_factory.mktemp("layers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ACTIVATIONS_ENV, "float")
        patch.setenv(DISABLE_ENV, "0")
        run_ranks(SIZE, [job(runner=False)], out)
        single = run_job(job(runner=False), SINGLE)
    return single, [load(out, "smollm2", rank) for rank in range(SIZE)]


def test_two_ranks_split_by_whole_kv_heads() -> None:
    config = open_model(str(embedded_model_path())).config
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    shares = [head_shard(TensorParallel(rank=rank, size=SIZE), 9, 3) for rank in range(SIZE)]
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in shares] == [
        (0, 3, 0, 1),
        (3, 6, 1, 2),
    ]


def test_four_ranks_are_refused_with_the_reason() -> None:
    """More ranks than KV heads replicate them, which needs a multiple of the 3 KV heads."""
    config = open_model(str(embedded_model_path())).config
    with pytest.raises(
        ValueError,
        match=r"--tensor-parallel-size 4 must be a multiple of the number of key/value heads \(3\)",
    ):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=4))


@pytest.mark.parametrize("path", ["runs", "layer_by_layer"])
def test_logits_match_size_one_and_are_the_same_bits_on_every_rank(
    path: str, request: pytest.FixtureRequest
) -> None:
    single, ranks = request.getfixturevalue(path)
    for step, expected in enumerate(single["logits"]):
        torch.testing.assert_close(ranks[0]["logits"][step], expected, atol=ATOL, rtol=0)
        for rank in ranks[1:]:
            assert torch.equal(rank["logits"][step], ranks[0]["logits"][step])
    for rank in ranks:
        for first, again in zip(rank["logits"], rank["logits_again"], strict=True):
            assert torch.equal(first, again)


def test_greedy_tokens_through_the_model_runner_equal_size_one(runs: Any) -> None:
    single, ranks = runs
    for rank in ranks:
        assert rank["tokens"] == single["tokens"]
        # 3 KV heads over 2 ranks: 1 and 2; the machine's KV budget cut 1:2, the same blocks each.
        assert [r["kv_cache_shape"][2] for r in ranks] == [1, 2]
        assert [r["kv_share"] for r in ranks] == pytest.approx([1 / 3, 2 / 3])
        assert (
            rank["num_blocks"]
            == int(ranks[0]["kv_bytes"] * ranks[0]["kv_share"]) // ranks[0]["kv_block_bytes"]
        )
        for ours, driver in zip(rank["token_tensors"], ranks[0]["token_tensors"], strict=True):
            assert torch.equal(ours, driver)


def test_each_rank_holds_about_half_the_packed_weights(runs: Any) -> None:
    single, ranks = runs
    shares = [rank["weight_bytes"] / single["weight_bytes"] for rank in ranks]
    # Rank 0 holds a third of the attention weights, rank 1 two thirds; the rest splits evenly.
    assert all(0.45 < share < 0.56 for share in shares), shares
    assert 1.0 <= sum(shares) < 1.03  # the norms are held whole by each rank


def test_loading_a_rank_peaks_well_under_the_memory_of_the_whole_model(runs: Any, tmp_path: Path) -> None:
    # Measured in a fresh process of its own (this one's peak is the whole test session's): one
    # rank of one loads the whole model, and only loads it.
    run_ranks(1, [replace(job(runner=False), logits=False)], tmp_path)
    whole = load(tmp_path, "smollm2", 0)["load_peak_bytes"]
    _, ranks = runs
    for rank in ranks:
        assert rank["load_peak_bytes"] < 0.65 * whole, (rank["load_peak_bytes"], whole)


def test_with_the_default_kernels_logits_and_greedy_tokens_match_size_ones(tmp_path: Path) -> None:
    # 16-bit activations and the fused C stack at both sizes, as `kvasir serve` runs. Before the
    # float64 row-parallel sums, a last-bit difference could move an activation to the next 16-bit
    # step, and the logits differed by up to ~7e-3.
    prompts = (*PROMPTS, tuple(range(100, 140)), (9, 8, 7, 6, 5))
    default = Job(
        "default", str(embedded_model_path()), prompts, decode_steps=12, kv_bytes=8 << 20, logits_again=False
    )
    run_ranks(SIZE, [default], tmp_path)
    single = run_job(default, SINGLE)
    for rank in range(SIZE):
        ours = load(tmp_path, "default", rank)
        assert ours["tokens"] == single["tokens"]
        for got, expected in zip(ours["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
