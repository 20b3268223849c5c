"""The CPU decoder stack (every layer of a step in one C call) against the layer-by-layer path.

The tiny Llama is written as GGUF and loaded packed (as the embedded model is). The layer-by-layer
path runs the same C kernels one call at a time, so the two agree to float32 rounding (the stack
computes SiLU with its own vector exponential); both are also held to the `gguf` package's
dequantization by `test_gguf_packed.py`, which runs the stack wherever it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.layers.quantization.gguf import ACTIVATIONS_ENV
from kvasir.runtime.models import cpu_decoder_stack
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tests.runtime.models.paged_runner import BLOCK_SIZE, PagedRunner
from tests.runtime.models.test_gguf_packed import DIMS, _prompts, build_pair, greedy_logits, write_gguf

Q4_0 = GGMLQuantizationType.Q4_0
pytestmark = pytest.mark.skipif(
    decoder_stack.library() is None, reason="no C compiler: the stack is not built"
)


@pytest.fixture(scope="module")
def gguf_of(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """family -> its tiny checkpoint written as a Q4_0 GGUF (Qwen2: q/k/v biases; Qwen3: q/k norms
    and a head_dim other than hidden / heads)."""
    written: dict[str, Path] = {}

    def write(family: str) -> Path:
        if family not in written:
            folder = tiny_checkpoint(family, **DIMS)
            written[family] = write_gguf(folder, Q4_0, tmp_path_factory.mktemp(family) / "q4_0.gguf")
        return written[family]

    return write


@pytest.fixture(scope="module")
def gguf_path(gguf_of: Callable[[str], Path]) -> Path:
    return gguf_of("llama")


def _packed(path: Path) -> LlamaForCausalLM:
    model, _ = build_pair(path)
    assert isinstance(model, LlamaForCausalLM)  # Qwen2 and Qwen3 are its subclasses
    return model


def _layers_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any decoder layer runs in Python (the stack must have run them all)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a decoder layer ran in Python")

    monkeypatch.setattr(LlamaDecoderLayer, "forward", refuse)


# Max logit error between the two paths, as a share of the logits' largest magnitude. With float
# activations only the SiLU's rounding differs. With int16 activations a last-bit difference in a
# GEMM's input can move its rounding to 16 bits by one step (1/32,258 of its block's largest value):
# measured 3.2e-5 (2026-11-26).
BOUNDS = {"float": 1e-5, "int16": 1e-4}


@pytest.mark.parametrize(
    ("family", "activations"),
    [("llama", "float"), ("llama", "int16"), ("qwen2", "float"), ("qwen3", "float"), ("qwen3", "int16")],
)
def test_stack_matches_the_layer_by_layer_path(
    family: str, activations: str, gguf_of: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACTIVATIONS_ENV, activations)
    path = gguf_of(family)
    prompts = _prompts(256, lengths=(29, 5, 17))
    monkeypatch.setenv(cpu_decoder_stack.DISABLE_ENV, "0")
    layered = _packed(path)
    expected_tokens, expected = greedy_logits(layered, prompts)
    assert layered.model._cpu_stack is None
    monkeypatch.delenv(cpu_decoder_stack.DISABLE_ENV)
    stacked, dequantized = build_pair(path)
    with monkeypatch.context() as patch:
        _layers_forbidden(patch)
        tokens, logits = greedy_logits(stacked, prompts)  # prompts of 29, 5 and 17 rows, then decode steps
    assert stacked.model._cpu_stack is not None
    assert tokens == expected_tokens
    scale = max(e.abs().max().item() for e in expected)
    error = max((o - e).abs().max().item() for o, e in zip(logits, expected, strict=True))
    assert error <= BOUNDS[activations] * scale, f"max logit error {error:.2e} (logits up to {scale:.1f})"
    # And the same tokens as the float model of the `gguf` package's dequantization.
    assert tokens == greedy_logits(dequantized, prompts)[0]


def test_stack_runs_a_prefix_of_the_layers(gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `num_layers` (a draft model reads the first layers of its target) stacks the first layers only.
    model = _packed(gguf_path)
    runner = PagedRunner(model)
    ids, positions = torch.tensor([5, 9, 13]), torch.arange(3)
    attn = runner_metadata(runner, 3)
    with monkeypatch.context() as patch, torch.inference_mode():
        _layers_forbidden(patch)  # the stack, not the layers, must run the prefix
        stacked = model.model(ids, positions, runner.kv_caches[:1], attn, num_layers=1)
    monkeypatch.setenv(cpu_decoder_stack.DISABLE_ENV, "0")
    layered_model = _packed(gguf_path)
    with torch.inference_mode():
        layered = layered_model.model(ids, positions, runner.kv_caches[:1], attn, num_layers=1)
    torch.testing.assert_close(stacked, layered, rtol=1e-5, atol=1e-5)


def runner_metadata(runner: PagedRunner, num_tokens: int) -> AttentionMetadata:
    """One request's first `num_tokens` tokens as step metadata over the runner's caches."""
    blocks = torch.tensor([runner.free.pop() for _ in range(2)], dtype=torch.int32)
    positions = torch.arange(num_tokens)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_table=blocks.view(1, -1),
        slot_mapping=(blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).long(),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )


def test_bad_slot_and_bad_block_are_named(gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _packed(gguf_path)
    runner = PagedRunner(model)
    attn = runner_metadata(runner, 2)
    ids, positions = torch.tensor([5, 9]), torch.arange(2)
    slots = attn.slot_mapping.clone()
    num_slots = runner.kv_caches[0][0].shape[0] * runner.kv_caches[0][0].shape[1]
    bad_slot = dataclasses.replace(attn, slot_mapping=torch.tensor([slots[0].item(), num_slots]))
    before = [k.clone() for k, _ in runner.kv_caches]
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] is outside"), torch.inference_mode():
        model.model(ids, positions, runner.kv_caches, bad_slot)
    assert all(
        torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before, strict=True)
    )  # nothing stored
    table = attn.block_table.clone()
    table[0, 0] = 10_000
    bad_block = dataclasses.replace(attn, block_table=table)
    refused = pytest.raises(ValueError, match="request 0: block_table holds a block id outside the cache")
    with refused, torch.inference_mode():
        model.model(ids, positions, runner.kv_caches, bad_block)


def test_models_the_stack_cannot_run_keep_the_layers(
    gguf_path: Path, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A float model (no packed projections): bound once, to nothing.
    float_model: CausalLM = build_pair(gguf_path)[1]
    assert cpu_decoder_stack.bind_decoder_stack(float_model.model) is None  # type: ignore[arg-type]
    # Switched off.
    monkeypatch.setenv(cpu_decoder_stack.DISABLE_ENV, "off")
    assert cpu_decoder_stack.bind_decoder_stack(_packed(gguf_path).model) is None
    monkeypatch.delenv(cpu_decoder_stack.DISABLE_ENV)
    # A projection the C kernel does not run (here: split into two kernels) keeps every layer in Python.
    packed = _packed(gguf_path)
    assert cpu_decoder_stack.bind_decoder_stack(packed.model) is not None
    o_proj = packed.model.layers[1].self_attn.o_proj
    assert o_proj.kernels is not None
    o_proj.kernels.append(o_proj.kernels[0])
    assert cpu_decoder_stack.bind_decoder_stack(packed.model) is None


def test_moving_the_model_forgets_the_binding(gguf_path: Path) -> None:
    model = _packed(gguf_path)
    runner = PagedRunner(model)
    with torch.inference_mode():
        runner.step([(0, [5, 6, 7], 0)])
    assert model.model._cpu_stack_bound
    model.float()  # `_apply`: buffers may have been replaced
    assert not model.model._cpu_stack_bound


class _CountingRanks:
    """A stand-in group of two ranks whose all-reduce leaves the sum as it is (this process plays
    both): what the stack hands its callback is recorded; `fail` makes it raise as a dead peer's
    collective does."""

    size = 2

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the peer is gone")
        self.calls.append((tensor.dtype, tuple(tensor.shape)))
        return tensor


def test_above_size_one_the_stack_all_reduces_after_o_and_down(
    gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two float64 all-reduces a layer, of [tokens, hidden], from inside the one C call; a sum left
    unchanged gives size 1's logits bit for bit (the all-reduce sits between the float64 sum and
    its rounding, as `RowParallelLinear`'s does)."""
    prompts = _prompts(256, lengths=(7, 3))
    _, expected = greedy_logits(_packed(gguf_path), prompts)
    model = _packed(gguf_path)
    ranks = _CountingRanks()
    model.model.parallel = ranks  # bound at the first forward pass, as a rank of two would be
    with monkeypatch.context() as patch:
        _layers_forbidden(patch)
        _, logits = greedy_logits(model, prompts)
    assert model.model._cpu_stack is not None
    for got, want in zip(logits, expected, strict=True):
        assert torch.equal(got, want)
    num_layers = len(model.model.layers)
    assert ranks.calls[: 2 * num_layers] == [(torch.float64, (10, model.config.hidden_size))] * (
        2 * num_layers
    )
    assert len(ranks.calls) % (2 * num_layers) == 0


def test_a_failed_all_reduce_in_the_stack_is_raised(gguf_path: Path) -> None:
    """A collective that fails (a dead rank) is raised from the step with its cause, never lost in C."""
    model = _packed(gguf_path)
    model.model.parallel = _CountingRanks(fail=True)
    with pytest.raises(RuntimeError, match="the all-reduce after layer 0's GEMM failed") as failure:
        greedy_logits(model, _prompts(256, lengths=(4,)))
    assert str(failure.value.__cause__) == "the peer is gone"
