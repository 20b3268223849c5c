"""CUDA graphs for decode steps: the bucket list, the padding contract, and that padding is harmless.

The padding checks run the tiny model eagerly on the CPU: a real decode batch against the same
batch padded to a bucket (directly, and through the static input buffers a graph reads). The real
rows must come out the same and the padding rows must leave the KV cache untouched. Capture and
replay themselves need CUDA (`gpu` test at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.worker.cuda_graphs import (
    MAX_GRAPH_BATCH_SIZE,
    DecodeInputBuffers,
    graph_batch_sizes,
    pad_decode_batch,
    padded_batch_size,
)
from kvasir.runtime.worker.model_runner import ModelInputs, ModelRunner

PROMPT_LENGTHS = (5, 19, 40)  # 1, 2 and 3 blocks of 16: block-table rows of different widths
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
TOL = 1e-5  # float32

# ---- the bucket list ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_batch_size", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (4, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (40, [1, 2, 4, 8, 16, 24, 32, 40]),
    ],
)
def test_graph_batch_sizes(max_batch_size: int, expected: list[int]) -> None:
    assert graph_batch_sizes(max_batch_size) == expected


def test_graph_batch_sizes_default_and_cap() -> None:
    sizes = graph_batch_sizes(256)
    assert sizes == [1, 2, 4, *range(8, 257, 8)]
    assert len(sizes) == 35
    assert graph_batch_sizes(10_000)[-1] == MAX_GRAPH_BATCH_SIZE
    assert graph_batch_sizes(10_000) == graph_batch_sizes(MAX_GRAPH_BATCH_SIZE)
    with pytest.raises(ValueError, match="max_batch_size"):
        graph_batch_sizes(0)


@pytest.mark.parametrize(
    ("num_requests", "expected"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, None)]
)
def test_padded_batch_size(num_requests: int, expected: int | None) -> None:
    assert padded_batch_size(num_requests, [1, 2, 4, 8]) == expected


# ---- the padding contract -----------------------------------------------------------------


def _three_decodes() -> tuple[Tensor, Tensor, AttentionMetadata]:
    block_table = torch.tensor([[3, 0, 0], [4, 5, 0], [6, 7, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 20, 33], dtype=torch.int32)
    positions = (seq_lens - 1).long()
    slots = torch.tensor([3 * 16 + 4, 5 * 16 + 3, 8 * 16 + 0])
    attn = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=33,
    )
    return torch.tensor([11, 12, 13]), positions, attn


def test_padding_follows_the_contract() -> None:
    input_ids, positions, attn = _three_decodes()
    ids, pos, padded = pad_decode_batch(input_ids, positions, attn, batch_size=8)
    assert ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert pos.tolist() == [4, 19, 32, 0, 0, 0, 0, 0]
    assert padded.slot_mapping.tolist() == [3 * 16 + 4, 5 * 16 + 3, 8 * 16, -1, -1, -1, -1, -1]
    assert padded.seq_lens.tolist() == [5, 20, 33, 1, 1, 1, 1, 1]
    assert padded.query_start_loc.tolist() == list(range(9))
    assert padded.block_table.tolist() == [[3, 0, 0], [4, 5, 0], [6, 7, 8], *[[0] * 3] * 5]
    assert (padded.max_query_len, padded.max_seq_len, padded.num_requests) == (1, 33, 8)
    # The dtypes the kernels check are kept.
    assert (ids.dtype, pos.dtype, padded.slot_mapping.dtype) == (torch.int64,) * 3
    assert (padded.seq_lens.dtype, padded.query_start_loc.dtype, padded.block_table.dtype) == (
        torch.int32,
    ) * 3


def test_padding_to_the_batch_size_itself_changes_nothing() -> None:
    input_ids, positions, attn = _three_decodes()
    ids, pos, padded = pad_decode_batch(input_ids, positions, attn, batch_size=3)
    assert torch.equal(ids, input_ids) and torch.equal(pos, positions)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(padded, name), getattr(attn, name)), name


def test_padding_rejects_what_does_not_fit() -> None:
    input_ids, positions, attn = _three_decodes()
    with pytest.raises(ValueError, match="batch_size"):
        pad_decode_batch(input_ids, positions, attn, batch_size=2)
    prompt = dataclasses.replace(attn, max_query_len=2)
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode_batch(input_ids, positions, prompt, batch_size=4)


def test_buffers_hold_exactly_the_padded_batch_after_a_larger_one() -> None:
    buffers = DecodeInputBuffers(max_batch_size=8, max_blocks_per_seq=5, device=torch.device("cpu"))
    for stale in (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens):
        stale.fill_(9)
    buffers.block_table.fill_(9)
    buffers.query_start_loc.fill_(9)
    input_ids, positions, attn = pad_decode_batch(*_three_decodes(), batch_size=4)
    buffers.load(input_ids, positions, attn)
    ids, pos, view = buffers.view(4, max_seq_len=80, workspace=None)
    assert ids.tolist() == [11, 12, 13, 0] and pos.tolist() == [4, 19, 32, 0]
    assert view.slot_mapping.tolist() == [3 * 16 + 4, 5 * 16 + 3, 8 * 16, -1]
    assert view.seq_lens.tolist() == [5, 20, 33, 1]
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Widened with zeros: no stale block id survives in a row the graph reads.
    assert view.block_table.tolist() == [[3, 0, 0, 0, 0], [4, 5, 0, 0, 0], [6, 7, 8, 0, 0], [0] * 5]
    assert (view.max_query_len, view.max_seq_len, view.num_requests) == (1, 80, 4)


def test_buffers_reject_a_batch_that_does_not_fit() -> None:
    buffers = DecodeInputBuffers(max_batch_size=4, max_blocks_per_seq=5, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(*pad_decode_batch(*_three_decodes(), batch_size=8))
    narrow = DecodeInputBuffers(max_batch_size=4, max_blocks_per_seq=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        narrow.load(*pad_decode_batch(*_three_decodes(), batch_size=4))


# ---- padding is harmless: the tiny model, eagerly, on the CPU -----------------------------


def _decoding_engine(path: Path, **overrides: object) -> LLMEngine:
    """An engine whose requests have all finished their prompts (the next step is decode-only).

    Synchronous: the tests plan the next step themselves, so none may already be in flight."""
    config = EngineConfig(
        model=str(path),
        device="cpu",
        dtype="float32",
        # A float16 cache (the CPU default) would round the GEMMs' last-bit differences between
        # a 3-row and a 4-row batch to a float16 ulp of K/V: far above TOL, yet no padding leak.
        kv_cache_dtype="float32",
        num_kv_blocks=80,
        async_scheduling=False,
        **overrides,  # type: ignore[arg-type]
    )
    engine = LLMEngine(config)
    generator = torch.Generator().manual_seed(7)
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(4, engine.model_config.vocab_size, (length,), generator=generator).tolist()
        engine.add_request(f"r{i}", params=GREEDY, prompt_token_ids=prompt)
    engine.step()  # the three prompts, in one step
    engine.step()  # one decode step, so the batch below reads KV written by a decode too
    return engine


def _decode_batch(engine: LLMEngine) -> ModelInputs:
    batch = engine.runner.prepare_inputs(engine.scheduler.schedule())
    assert batch.attn.max_query_len == 1 and batch.num_tokens == len(PROMPT_LENGTHS)
    return batch


def _forward(
    runner: ModelRunner, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Run the model eagerly on a copy of the runner's KV cache; return hidden states and that copy."""
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        hidden = runner.model(
            input_ids, positions, caches, dataclasses.replace(attn, workspace=runner.attention_workspace)
        )
    return hidden, caches


def _check_padded_run(
    runner: ModelRunner,
    batch: ModelInputs,
    run_padded: Callable[[], tuple[Tensor, list[tuple[Tensor, Tensor]]]],
) -> None:
    """The real rows of the padded run equal the unpadded run; padding wrote no KV anywhere."""
    # The step's own slots hold a sentinel first: whatever an earlier test (or a reused allocation)
    # left there could equal what this step writes, and "the real rows did write" would not hold.
    for layer in runner.kv_caches:
        for cache in layer:
            cache.flatten(0, 1)[batch.attn.slot_mapping] = 1000.0
    hidden, caches = _forward(runner, batch.input_ids, batch.positions, batch.attn)
    padded_hidden, padded_caches = run_padded()
    num_real = batch.attn.num_requests
    assert padded_hidden.shape[0] > num_real
    real_logits = runner.model.compute_logits(hidden)
    padded_logits = runner.model.compute_logits(padded_hidden[:num_real])
    # Not bit-identical: CPU GEMMs block a 3-row and a 4-row product differently (last-bit
    # differences, ~5e-7 per layer here), and split-K picks its splits from the batch size. A
    # padding row leaking into a real one would show at the scale of the activations (~1).
    torch.testing.assert_close(padded_hidden[:num_real], hidden, atol=TOL, rtol=TOL)
    torch.testing.assert_close(padded_logits, real_logits, atol=TOL, rtol=TOL)

    real_slots = batch.attn.slot_mapping
    untouched = torch.ones(runner.num_blocks * runner.block_size, dtype=torch.bool)
    untouched[real_slots] = False
    for before, after_real, after_padded in zip(runner.kv_caches, caches, padded_caches, strict=True):
        for cache_before, cache_real, cache_padded in zip(before, after_real, after_padded, strict=True):
            flat_before = cache_before.flatten(0, 1)
            flat_real, flat_padded = cache_real.flatten(0, 1), cache_padded.flatten(0, 1)
            # Bit patterns: slots never written hold whatever the allocator left (NaN != NaN).
            untouched_after, untouched_before = flat_padded[untouched], flat_before[untouched]
            assert torch.equal(untouched_after.view(torch.uint8), untouched_before.view(torch.uint8)), (
                "a padding row wrote KV"
            )
            torch.testing.assert_close(flat_padded[real_slots], flat_real[real_slots], atol=TOL, rtol=TOL)
            assert not torch.equal(flat_real[real_slots], flat_before[real_slots])  # the real rows did write


# (KVASIR_KERNELS, family, checkpoint overrides). For Triton, one KV head and a 1024-token context:
# at max_seq_len 1024 the decode kernel splits each request in two (through the workspace), as a
# graph captured at max_model_len does.
BACKENDS = [
    pytest.param(("torch", "llama-gqa-llama3-rope", {}), id="torch-llama-gqa"),
    pytest.param(("torch", "mistral", {}), id="torch-mistral-sliding-window"),
    pytest.param(
        ("triton", "llama-gqa-llama3-rope", {"max_position_embeddings": 1024}),
        id="triton-interpreter-llama-gqa",
    ),
]


@pytest.fixture(params=BACKENDS)
def decoding_engine(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> LLMEngine:
    backend, family, overrides = request.param
    monkeypatch.setenv("KVASIR_KERNELS", backend)  # for the whole test, not only the engine's steps
    engine = _decoding_engine(tiny_checkpoint(family, **overrides))
    assert (engine.runner.attention_workspace is not None) == (backend == "triton")
    return engine


def test_padded_decode_batch_matches_the_real_one(decoding_engine: LLMEngine) -> None:
    runner = decoding_engine.runner
    batch = _decode_batch(decoding_engine)
    bucket = padded_batch_size(batch.attn.num_requests, graph_batch_sizes(8))
    assert bucket == 4

    def run_padded() -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        return _forward(runner, *pad_decode_batch(batch.input_ids, batch.positions, batch.attn, bucket))

    _check_padded_run(runner, batch, run_padded)


def test_static_buffers_replay_a_smaller_batch_after_a_larger_one(decoding_engine: LLMEngine) -> None:
    """What a graph does, minus the graph: load into the static buffers and run on their views
    (a block table as wide as the longest sequence, `max_seq_len` at the model's maximum); the
    stale rows of a larger batch must not leak in."""
    runner = decoding_engine.runner
    batch = _decode_batch(decoding_engine)
    max_blocks = -(-runner.max_model_len // runner.block_size)
    buffers = DecodeInputBuffers(max_batch_size=8, max_blocks_per_seq=max_blocks, device=runner.device)
    # A larger batch left behind: real-looking slots and lengths in every row.
    buffers.input_ids.fill_(7)
    buffers.positions.fill_(3)
    buffers.slot_mapping.copy_(torch.arange(8) + runner.block_size)
    buffers.seq_lens.fill_(4)
    buffers.block_table.fill_(1)

    def run_padded() -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        buffers.load(*pad_decode_batch(batch.input_ids, batch.positions, batch.attn, 4))
        return _forward(runner, *buffers.view(4, runner.max_model_len, runner.attention_workspace))

    _check_padded_run(runner, batch, run_padded)


# ---- configuration ------------------------------------------------------------------------


def test_no_graphs_off_cuda(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu", num_kv_blocks=32))
    assert engine.runner.decode_graphs is None


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, False),
        (["--enforce-eager"], None, True),
        ([], "1", True),
        ([], "false", False),
    ],
)
def test_enforce_eager_flag(
    argv: list[str], env: str | None, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is None:
        monkeypatch.delenv("KVASIR_ENFORCE_EAGER", raising=False)
    else:
        monkeypatch.setenv("KVASIR_ENFORCE_EAGER", env)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--model", "some/folder", *argv]))
    assert config.enforce_eager is expected


# ---- CUDA: graph replay against the eager path --------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device to capture and replay CUDA graphs"
)
def test_graph_replay_matches_eager_on_cuda(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVASIR_KERNELS", raising=False)  # Triton on CUDA: the capturable kernels
    path = tiny_checkpoint("mistral")
    common = {
        "model": str(path),
        "device": "cuda",
        "dtype": "float32",
        "num_kv_blocks": 64,
        "max_num_seqs": 16,
        "async_scheduling": False,  # the test plans a step itself: none may be in flight
    }
    engine = LLMEngine(EngineConfig(**common))  # type: ignore[arg-type]
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8, 16]

    # One step, directly: replay (padded to 4) against eager on a copy of the same KV cache.
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(4, engine.model_config.vocab_size, (n,), generator=generator).tolist()
        for n in PROMPT_LENGTHS
    ]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", params=GREEDY, prompt_token_ids=prompt)
    engine.step()
    batch = runner.prepare_inputs(engine.scheduler.schedule())
    assert graphs.can_run(batch.attn)
    device_attn = batch.attn.to(runner.device, runner.attention_workspace)
    eager_hidden, eager_caches = _forward(
        runner, batch.input_ids.to(runner.device), batch.positions.to(runner.device), device_attn
    )
    graph_hidden = graphs.run(batch.input_ids, batch.positions, batch.attn)  # writes runner.kv_caches
    torch.testing.assert_close(graph_hidden, eager_hidden, atol=1e-4, rtol=1e-4)
    for (k, v), (eager_k, eager_v) in zip(runner.kv_caches, eager_caches, strict=True):
        torch.testing.assert_close(k, eager_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, eager_v, atol=1e-4, rtol=1e-4)

    # End to end, on a fresh engine (the one above has a step scheduled and never finished):
    # greedy tokens through the graphs (batches of 3, 2, 1 as requests finish) equal an eager
    # engine's.
    graph_engine = LLMEngine(EngineConfig(**common))  # type: ignore[arg-type]
    graphs = graph_engine.runner.decode_graphs
    assert graphs is not None
    replayed: list[int] = []
    original_run = graphs.run

    def counting_run(input_ids: Tensor, positions: Tensor, attn: AttentionMetadata) -> Tensor:
        replayed.append(attn.num_requests)
        return original_run(input_ids, positions, attn)

    monkeypatch.setattr(graphs, "run", counting_run)
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in (6, 12, 24)]
    with_graphs = graph_engine.generate(prompts, params)
    eager_engine = LLMEngine(EngineConfig(**common, enforce_eager=True))  # type: ignore[arg-type]
    assert eager_engine.runner.decode_graphs is None
    eager = eager_engine.generate(prompts, params)
    assert [r.choices[0].token_ids for r in with_graphs] == [r.choices[0].token_ids for r in eager]
    assert {1, 2, 3} <= set(replayed)
