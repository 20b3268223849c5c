"""LoRA adapters for the tests, written by `peft` (a test-only dependency) in its own format.

`make_peft_adapter(base, path, rank, ...)` wraps the checkpoint at `base` with a PEFT `LoraConfig`
on all seven projections, fills A and B from a fixed seed (PEFT starts B at zero, which would make
the adapter a no-op) and saves it with `save_pretrained`: adapter_config.json and
adapter_model.safetensors, exactly as a user's fine-tune would be. `write_adapter` writes the same
layout directly, fast and without building a model, for tests of the files themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.loader.lora_adapter import TARGET_MODULES, module_shapes


def make_peft_adapter(
    base: Path,
    path: Path,
    rank: int,
    *,
    alpha: int = 16,
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
    wrapped.save_pretrained(str(path))
    return path


def write_adapter(
    path: Path,
    model_config: ModelConfig,
    rank: int,
    *,
    seed: int = 0,
    alpha: float = 16.0,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    layers: tuple[int, ...] | None = None,
) -> Path:
    """An adapter in PEFT's layout written directly (no model built): random A and B for every
    module of `layers` (default: all), `config` fields and `tensors` added or replacing."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for layer in range(model_config.num_hidden_layers) if layers is None else layers:
        for module, (n_in, n_out) in module_shapes(model_config).items():
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) / n_in**0.5
            weights[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.1
    weights.update(tensors or {})
    fields: dict[str, Any] = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    fields.update(config or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(fields))
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path
