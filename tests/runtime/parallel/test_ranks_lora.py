"""LoRA calls reach every rank: an adapter added on rank 0 (mirrored to the other rank) gives at
two ranks the tokens it gives in one process, and a bad adapter is the caller's error, not a
failed group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.lora.errors import LoRAAdapterError
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams
from tests.lora_adapters import make_peft_adapter

PROMPT = [5, 9, 14, 3, 7, 7, 21, 40]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _run(base: Path, adapter: Path, size: int) -> tuple[list[int], list[int]]:
    """(tokens with the adapter, tokens without) from an engine of `size` ranks."""
    config = EngineConfig(
        model=str(base), device="cpu", max_model_len=64, num_kv_blocks=32, enable_lora=True,
        max_lora_rank=8, tensor_parallel_size=size,
    )  # fmt: skip
    engine = LLMEngine(config)
    try:
        digest, rank = engine.identify_lora(str(adapter))
        engine.add_lora(LoRARequest("a", 1, str(adapter), digest, rank))
        with pytest.raises(LoRAAdapterError):  # rank 0 refuses it; the other rank only logs it
            engine.add_lora(LoRARequest("bad", 2, str(base / "no-such-adapter"), digest, rank))
        engine.add_request(
            "with",
            None,
            PARAMS,
            prompt_token_ids=PROMPT,
            lora=LoRARequest("a", 1, str(adapter), digest, rank),
        )
        engine.add_request("without", None, PARAMS, prompt_token_ids=PROMPT)
        tokens: dict[str, list[int]] = {"with": [], "without": []}
        while engine.has_unfinished():
            for output in engine.step():
                for delta in output.outputs:
                    tokens[output.request_id].extend(delta.token_ids)
        engine.remove_lora(1)
        return tokens["with"], tokens["without"]
    finally:
        engine.close()


def test_an_adapter_at_two_ranks_gives_the_tokens_of_one(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    base = tiny_checkpoint("llama")
    adapter = make_peft_adapter(base, tmp_path / "adapter", 8)
    one = _run(base, adapter, 1)
    assert one[0] != one[1]  # the adapter changes the output: it ran
    assert _run(base, adapter, 2) == one
