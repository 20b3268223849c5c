"""LoRA in the CPU decoder stack (one C call per step) against the layer-by-layer LoRA path, which
`test_lora_parity` holds to PEFT and `tests/kernels/test_lora.py` to the torch reference.

The tiny Llama is written as a packed GGUF (as the embedded model is) and served from the worker's
real slot pool (`LoRASlots`, adapters read from PEFT-layout files): three adapters of ranks below
the pool's, a fourth slot no row uses, base rows mixed in, prompts of many rows per request (the
prefill chunks) and then decode steps. A base row's output in a step with adapter rows is, bit for
bit, what it is in a step without them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.kernels.cpu_ops.decoder_stack import DecoderStack
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.layers.quantization.gguf import ACTIVATIONS_ENV
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.models import cpu_decoder_stack
from kvasir.runtime.models.llama import LlamaForCausalLM
from kvasir.runtime.worker.lora_slots import LoRASlots, StepAdapters
from tests.lora_adapters import write_adapter
from tests.runtime.models.paged_runner import PagedRunner
from tests.runtime.models.test_cpu_decoder_stack import _layers_forbidden, _packed
from tests.runtime.models.test_gguf_packed import DIMS, _prompts, write_gguf

pytestmark = pytest.mark.skipif(
    decoder_stack.library() is None, reason="no C compiler: the stack is not built"
)

MAX_RANK = 8
ADAPTER_RANKS = (2, 8, 5)  # in slots 0..2 of 4: slot 3 holds nothing
# Each request's adapter (index into ADAPTER_RANKS) or -1: the base model.
REQUEST_ADAPTERS = (0, -1, 2, 1, 0, -1)
PROMPT_LENGTHS = (29, 5, 17, 9, 3, 12)
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def gguf_path(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a Q4_0 GGUF."""
    folder = tiny_checkpoint("llama", **DIMS)
    return write_gguf(folder, GGMLQuantizationType.Q4_0, tmp_path_factory.mktemp("llama") / "q4_0.gguf")


def _slots(model: LlamaForCausalLM, path: Path, root: Path) -> tuple[LoRASlots, tuple[LoRARequest, ...]]:
    config = EngineConfig(model=str(path), enable_lora=True, max_loras=4, max_lora_rank=MAX_RANK)
    slots = LoRASlots(config, model.config, torch.device("cpu"), torch.float32)
    loras = []
    for index, rank in enumerate(ADAPTER_RANKS):
        folder = write_adapter(root / f"a{index}", model.config, rank, seed=index + 1)
        loras.append(LoRARequest(f"a{index}", index + 1, str(folder), b"", rank))
        slots.add(loras[-1])
    assert slots.stack_pool is not None  # float32 on the CPU: the C stack reads this pool
    return slots, tuple(loras)


def _lora_attach(
    slots: LoRASlots, loras: tuple[LoRARequest, ...], request_adapters: list[int], lengths: list[int]
) -> Callable[[AttentionMetadata], AttentionMetadata]:
    rows = np.repeat(np.array(request_adapters, dtype=np.int64), lengths)
    return lambda attn: slots.bind_step(StepAdapters(loras, rows), attn)


def _generate(
    model: LlamaForCausalLM,
    slots: LoRASlots | None,
    loras: tuple[LoRARequest, ...],
    adapters: tuple[int, ...],
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt in one step, then greedy decode steps of the whole batch; with `slots`,
    request i runs adapter adapters[i]. Returns the tokens and every step's logits."""
    prompts = _prompts(model.config.vocab_size, lengths=PROMPT_LENGTHS)
    runner = PagedRunner(model)
    chunks = [(r, p, 0) for r, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    for _ in range(DECODE_STEPS + 1):
        attach = None
        if slots is not None:
            attach = _lora_attach(slots, loras, list(adapters), [len(c[1]) for c in chunks])
        last = [rows[-1] for rows in runner.step(chunks, attach)]
        all_logits.append(torch.stack(last))
        for r, logits in enumerate(last):
            tokens[r].append(int(logits.argmax()))
        chunks = [(r, [tokens[r][-1]], len(prompts[r]) + len(tokens[r]) - 1) for r in range(len(prompts))]
    return tokens, all_logits


def test_stack_with_adapters_matches_the_layer_by_layer_path(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACTIVATIONS_ENV, "float")  # the two paths differ by float32 sum order only
    path = gguf_path
    monkeypatch.setenv(cpu_decoder_stack.DISABLE_ENV, "0")
    layered = _packed(path)
    slots, loras = _slots(layered, path, tmp_path)
    expected_tokens, expected = _generate(layered, slots, loras, REQUEST_ADAPTERS)
    assert layered.model._cpu_stack is None
    monkeypatch.delenv(cpu_decoder_stack.DISABLE_ENV)
    stacked = _packed(path)
    with monkeypatch.context() as patch:
        _layers_forbidden(patch)  # every step, prefill and decode, adapters and all, runs in C
        tokens, logits = _generate(stacked, slots, loras, REQUEST_ADAPTERS)
    assert stacked.model._cpu_stack is not None
    assert tokens == expected_tokens
    scale = max(e.abs().max().item() for e in expected)
    error = max((o - e).abs().max().item() for o, e in zip(logits, expected, strict=True))
    assert error <= 1e-5 * scale, f"max logit error {error:.2e} (logits up to {scale:.1f})"
    # The adapters matter: each adapter's requests differ from the base model's.
    _, base_logits = _generate(stacked, None, loras, REQUEST_ADAPTERS)
    for r, adapter in enumerate(REQUEST_ADAPTERS):
        change = max((o[r] - b[r]).abs().max().item() for o, b in zip(logits, base_logits, strict=True))
        assert (change > 100 * error) if adapter >= 0 else change == 0.0, (r, change)


def test_base_rows_are_bit_identical_with_and_without_adapter_rows(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default (int16) activations: a base row's arithmetic does not depend on its neighbours'
    # adapters, and a LoRA step whose rows all run the base model is the base step, bit for bit.
    path = gguf_path
    model = _packed(path)
    slots, loras = _slots(model, path, tmp_path)
    given: list[object] = []
    original = DecoderStack.run

    def spy(self: DecoderStack, *args: Any) -> Any:
        given.append(args[5] if len(args) > 5 else None)
        return original(self, *args)

    monkeypatch.setattr(DecoderStack, "run", spy)
    _, base = _generate(model, None, loras, REQUEST_ADAPTERS)
    assert len(given) == DECODE_STEPS + 1 and given == [None] * len(given)  # base steps: NULL LoRA in C
    _, mixed = _generate(model, slots, loras, REQUEST_ADAPTERS)
    _, no_rows = _generate(model, slots, loras, (-1,) * len(REQUEST_ADAPTERS))
    base_requests = [r for r, adapter in enumerate(REQUEST_ADAPTERS) if adapter < 0]
    for step_base, step_mixed, step_none in zip(base, mixed, no_rows, strict=True):
        assert torch.equal(step_mixed[base_requests], step_base[base_requests])
        assert torch.equal(step_none, step_base)
