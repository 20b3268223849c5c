"""With --enable-lora, a step whose batch has no adapter row runs exactly the base code: no LoRA
code is entered, the CPU decoder stack and CUDA graphs take it as before, and its tokens are those
of an engine without the flag. A step with an adapter row runs the LoRA code (in the C stack where
the model is packed and on the CPU, `test_lora_stack.py`; layer by layer otherwise).

The packed model's base steps hand the C stack no LoRA at all (NULL in C): `test_lora_stack.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvasir.kernels import lora as lora_kernels
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.layers import lora as lora_layers
from kvasir.runtime.layers.lora import LoRAStep
from kvasir.runtime.loader.lora_adapter import read_adapter_digest
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.models.llama import LlamaModel
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.worker.lora_slots import LoRASlots
from tests.lora_adapters import write_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)


def _engine(base: Path, **settings: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", **settings))  # type: ignore[arg-type]


def _forbid(monkeypatch: pytest.MonkeyPatch, entered: list[str]) -> None:
    """Record any entry into the LoRA code (the kernels, the layers' path, the slot binding)."""

    def spy(name: str, original):
        def wrapper(*args, **kwargs):
            entered.append(name)
            return original(*args, **kwargs)

        return wrapper

    for name in ("lora_shrink", "lora_expand"):
        monkeypatch.setattr(lora_kernels, name, spy(name, getattr(lora_kernels, name)))
        monkeypatch.setattr(lora_layers, name, spy(name, getattr(lora_layers, name)))
    monkeypatch.setattr(LoRAStep, "linear", spy("LoRAStep.linear", LoRAStep.linear))
    monkeypatch.setattr(LoRASlots, "bind_step", spy("bind_step", LoRASlots.bind_step))


def test_base_only_steps_never_enter_lora_code(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    base = tiny_checkpoint("llama")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12] * 7]
    expected = [r.choices[0].token_ids for r in _engine(base).generate(prompts, GREEDY)]
    engine = _engine(base, enable_lora=True, max_lora_rank=8)
    path = write_adapter(tmp_path / "a", engine.runner.model_config, 8)
    engine.runner.add_lora(LoRARequest("a", 1, str(path), b"", 8))  # loaded, but no request uses it
    entered: list[str] = []
    _forbid(monkeypatch, entered)
    stacks: list[bool] = []
    original_stack = LlamaModel._run_cpu_stack

    def counted_stack(self: LlamaModel, *args: Any) -> Any:
        stacks.append(True)
        return original_stack(self, *args)

    monkeypatch.setattr(LlamaModel, "_run_cpu_stack", counted_stack)
    assert [r.choices[0].token_ids for r in engine.generate(prompts, GREEDY)] == expected
    assert entered == []
    assert stacks  # every base step offered itself to the CPU decoder stack, as without the flag

    # The same engine with an adapter request: the LoRA code runs. The step is offered to the C
    # stack (which runs adapter rows on packed CPU models, `test_lora_stack.py`); this float model
    # has none, so the layers add the adapters' terms.
    stacks.clear()
    lora = LoRARequest("a", 1, str(path), read_adapter_digest(path, engine.runner.model_config, 8), 8)
    engine.add_request("x", None, GREEDY, prompt_token_ids=prompts[0], lora=lora)
    while engine.has_unfinished():
        engine.step()
    assert "bind_step" in entered and "lora_shrink" in entered and stacks
    assert engine.runner.model.model._cpu_stack is None


class _RecordingGraphs:
    """Stands in for the CUDA graph runner (no GPU here): says it can run every decode step and
    records the ones it is given, running them eagerly."""

    def __init__(self, runner) -> None:
        self.runner, self.replays = runner, 0

    def can_run(self, attn) -> bool:
        return attn.max_query_len == 1

    def run(self, input_ids, positions, attn):
        self.replays += 1
        assert attn.lora is None
        return self.runner.model(input_ids, positions, self.runner.kv_caches, attn)


def test_decode_graphs_take_base_steps_and_never_adapter_steps(tiny_checkpoint, tmp_path) -> None:
    base = tiny_checkpoint("llama")
    engine = _engine(base, enable_lora=True, max_lora_rank=8)
    graphs = _RecordingGraphs(engine.runner)
    engine.runner.decode_graphs = graphs  # type: ignore[assignment]
    engine.generate([[5, 6, 7, 8]], GREEDY)
    assert GREEDY.max_tokens is not None and graphs.replays == GREEDY.max_tokens - 1  # every decode step
    path = write_adapter(tmp_path / "a", engine.runner.model_config, 8)
    lora = LoRARequest("a", 1, str(path), b"", 8)
    engine.runner.add_lora(lora)
    graphs.replays = 0
    engine.add_request("x", None, GREEDY, prompt_token_ids=[5, 6, 7, 8], lora=lora)
    while engine.has_unfinished():
        engine.step()
    assert graphs.replays == 0


def test_adapter_rows_and_base_rows_in_one_step_are_independent(tiny_checkpoint, tmp_path) -> None:
    # A base request batched with adapter requests gets the same tokens as alone.
    base = tiny_checkpoint("llama")
    alone = _engine(base).generate([[20, 21, 22, 23, 24]], GREEDY)[0].choices[0].token_ids
    engine = _engine(base, enable_lora=True, max_lora_rank=8)
    path = write_adapter(tmp_path / "a", engine.runner.model_config, 8)
    lora = LoRARequest("a", 1, str(path), b"", 8)
    engine.runner.add_lora(lora)
    engine.add_request("adapter", None, GREEDY, prompt_token_ids=[30, 31, 32], lora=lora)
    engine.add_request("base", None, GREEDY, prompt_token_ids=[20, 21, 22, 23, 24])
    tokens: dict[str, list[int]] = {"adapter": [], "base": []}
    while engine.has_unfinished():
        for output in engine.step():
            for delta in output.outputs:
                tokens[output.request_id] += delta.token_ids
    assert tokens["base"] == alone
    assert torch.tensor(tokens["adapter"]).numel() == GREEDY.max_tokens
