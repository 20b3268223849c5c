"""LoRA adapters for the tests, written by `peft` (a test-only dependency) in its own format.

`make_peft_adapter(base, path, rank, ...)` wraps the checkpoint at `base` with a PEFT `LoraConfig`
on all seven projections, fills A and B from a fixed seed (PEFT starts B at zero, which would make
the adapter a no-op) and saves it with `save_pretrained`: adapter_config.json and
adapter_model.safetensors, exactly as a user's fine-tune would be.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvasir.runtime.loader.lora_adapter import TARGET_MODULES


def make_peft_adapter(
    base: Path,
    path: Path,
    rank: int,
    *,
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
    magnitude: float = 0.5,
    target_modules: tuple[str, ...] = TARGET_MODULES,
) -> Path:
    """Write a random, non-zero LoRA adapter for `base` to `path` and return it."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0
    )
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * magnitude / rank**0.5)
    wrapped.save_pretrained(path)
    return path
