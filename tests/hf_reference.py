"""What Hugging Face `transformers` generates: the independent reference of the parity tests."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
import torch
import transformers


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While the block runs, transformers' GGUF loading parses each file once and builds gguf's
    tensor-name table once: it parses a model's file twice (config, then weights; a tokenizer's
    strings are most of it) and builds the table once per submodule, the same each time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of exactly `new_tokens` tokens (EOS suppressed), one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # EOS suppressed, as min_tokens does on our side
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs
