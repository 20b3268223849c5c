"""A packed GGUF model with LoRA adapter rows at two ranks, through the fused CPU decoder stack.

The tiny Llama (4 heads, 2 KV heads, hidden 256, MLP 512) is written as a Q4_0 GGUF, so every
rank's shard stays packed and binds the C stack (`runtime/models/cpu_decoder_stack.py`); each rank
reads its share of a rank-4 adapter on all seven projections into its own slot pool. In every
step the even-numbered requests run the adapter and the odd ones the base model; two of them share
a prompt, so an adapter row and a base row of the same tokens sit in one batch.

Float activations (`KVASIR_GGUF_CPU_ACTIVATIONS=float`), as in `test_sharded_gguf.py`. At two
ranks the logits are within 1e-4 of one process's, the same bits on both ranks and in a second
pass, and greedy tokens (over the paged cache and through `ModelRunner` with a scheduler) equal
size 1's. Measured: the base rows equal size 1's, the adapter rows 8.5e-6 apart, not the same bits:
a row-parallel adapter term `B @ (A_r @ x_r)` shrinks over each rank's part of the inputs, so its
float32 sums split where size 1's do not (docs/tensor-parallel.md, Numerics). A base row is, bit for bit, what it is in a step without
adapters. Every forward pass at both sizes ran in the stack (never the layer-by-layer fallback).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.runtime.layers.quantization.gguf import ACTIVATIONS_ENV
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.parallel.group import SINGLE
from tests.lora_adapters import write_adapter
from tests.runtime.models.test_gguf_packed import DIMS, write_gguf
from tests.runtime.parallel.sharded_ranks import Job, load, run_job, run_ranks

pytestmark = pytest.mark.skipif(
    decoder_stack.library() is None, reason="no C compiler: the fused stack is not built"
)

ATOL = 1e-4
SIZE = 2
# Requests 0 and 2 run the adapter, 1 and 3 not; 0 and 1 are the same prompt.
PROMPTS = ((5, 9, 14, 3, 7, 7, 21, 40, 11), (5, 9, 14, 3, 7, 7, 21, 40, 11), (17, 30, 2), (60, 8, 8, 91, 4))
ADAPTER_ROWS = [0, 2]
BASE_ROWS = [1, 3]


@pytest.fixture(scope="module")
def runs(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """job name -> (size 1's results, [rank 0's, rank 1's]), for the adapter job and the base one."""
    folder = tmp_path_factory.mktemp("gguf-lora")
    gguf = write_gguf(
        tiny_checkpoint("llama", **DIMS), GGMLQuantizationType.Q4_0, folder / "q4_0.gguf", vocabulary=True
    )
    adapter = write_adapter(folder / "adapter", open_model(str(gguf)).config, 4, seed=3)
    jobs = [
        Job("lora", str(gguf), PROMPTS, decode_steps=4, kv_bytes=8 << 20, lora=str(adapter)),
        Job("base", str(gguf), PROMPTS, decode_steps=4, runner=False),
    ]
    out = tmp_path_factory.mktemp("ranks")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ACTIVATIONS_ENV, "float")  # the spawned ranks inherit it
        run_ranks(SIZE, jobs, out)
        return {
            job.name: (run_job(job, SINGLE), [load(out, job.name, r) for r in range(SIZE)]) for job in jobs
        }


def test_every_step_ran_in_the_fused_stack_at_both_sizes(runs: dict[str, Any]) -> None:
    for single, ranks in runs.values():
        for result in (single, *ranks):
            # A prefill and 4 decode steps, twice: none fell back to the layers in Python.
            assert result["stack_steps"] == [True] * 10
    single, ranks = runs["lora"]
    assert all(result["runner_stack_bound"] for result in (single, *ranks))


def test_logits_with_adapter_rows_match_size_one_and_are_the_same_bits_on_every_rank(
    runs: dict[str, Any],
) -> None:
    single, ranks = runs["lora"]
    for step, expected in enumerate(single["logits"]):
        torch.testing.assert_close(ranks[0]["logits"][step], expected, atol=ATOL, rtol=0)
        assert torch.equal(ranks[1]["logits"][step], ranks[0]["logits"][step]), f"step {step}"
    for rank in ranks:
        for first, again in zip(rank["logits"], rank["logits_again"], strict=True):
            assert torch.equal(first, again)
    # The greedy tokens over the paged cache (each decode step's argmax) are size 1's.
    for got, expected in zip(ranks[0]["logits"][1:], single["logits"][1:], strict=True):
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_adapter_changes_its_rows_and_leaves_the_base_rows_bit_for_bit(runs: dict[str, Any]) -> None:
    for single, ranks in (runs["lora"][0], runs["base"][0]), (runs["lora"][1][0], runs["base"][1][0]):
        # Decode steps: [request, vocab]. Same prompt, one with the adapter: far apart.
        assert (single["logits"][1][0] - single["logits"][1][1]).abs().max() > 100 * ATOL
        for with_rows, without in zip(single["logits"][1:], ranks["logits"][1:], strict=True):
            assert torch.equal(with_rows[BASE_ROWS], without[BASE_ROWS])
            assert (with_rows[ADAPTER_ROWS] - without[ADAPTER_ROWS]).abs().max() > 100 * ATOL


def test_greedy_tokens_through_the_model_runner_equal_size_one(runs: dict[str, Any]) -> None:
    single, ranks = runs["lora"]
    assert single["tokens"]["r0"] != single["tokens"]["r1"]  # the adapter ran (same prompt)
    for rank in ranks:
        assert rank["tokens"] == single["tokens"]
        for ours, driver in zip(rank["token_tensors"], ranks[0]["token_tensors"], strict=True):
            assert torch.equal(ours, driver)
