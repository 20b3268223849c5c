"""What Hugging Face `transformers` generates: the independent reference of the parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


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
