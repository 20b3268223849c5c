"""Random-weight models of real shapes, built in device memory (no checkpoint is written), for Kvasir
and `transformers` alike: both load the very same tensors.

`RandomWeights` is a `WeightSource`: it yields `(hf_name, tensor)` for every parameter of the Kvasir
model class (names read off a meta-device instance), each tensor drawn on the device from a
generator seeded by (seed, name). Iterating twice gives identical tensors, so the engine and the
Hugging Face model are loaded one after the other and never need to share memory.
"""

from __future__ import annotations

import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import BOS_ID, EOS_ID, PAD_ID, write_word_level_tokenizer

# transformers' default `initializer_range`: keeps activations of a deep random model finite.
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class ModelShape:
    """The architecture of a benchmark model, in Hugging Face config terms."""

    label: str
    architecture: str  # LlamaForCausalLM | Qwen3ForCausalLM
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = field(default=None)

    def hf_config(self) -> Any:
        """The `transformers` config of this shape (the same one a checkpoint's config.json holds)."""
        import transformers

        # A dict like a checkpoint's config.json, read the way transformers reads one.
        values: dict[str, Any] = {
            "architectures": [self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        }
        config_class: dict[str, Any] = {
            "Qwen3ForCausalLM": transformers.Qwen3Config,
            "LlamaForCausalLM": transformers.LlamaConfig,
        }
        if self.architecture in config_class:
            return config_class[self.architecture].from_dict(values)
        raise ValueError(f"architecture {self.architecture!r} is not one of the benchmark shapes")


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# The real models' config.json values (Qwen/Qwen3-0.6B, meta-llama/Llama-3.1-8B).
SHAPES = {
    "qwen3-0.6b": ModelShape(
        "Qwen3-0.6B-shaped", "Qwen3ForCausalLM", 1024, 3072, 28, 16, 8, 128, 151936, True, 1e6, 1e-6, 40960
    ),
    "llama3-8b": ModelShape(
        "Llama-3-8B-shaped", "LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128, 128256, False, 5e5, 1e-5, 131072,
        _LLAMA3_ROPE,
    ),
}  # fmt: skip
# The same architectures, tiny, for CPU smoke runs (q/k norm, tied embeddings, llama3 rope kept).
SMOKE_SHAPES = {
    "qwen3-0.6b": ModelShape(
        "tiny Qwen3", "Qwen3ForCausalLM", 64, 128, 2, 4, 2, 16, 512, True, 1e6, 1e-6, 4096
    ),
    "llama3-8b": ModelShape(
        "tiny Llama-3", "LlamaForCausalLM", 64, 128, 2, 4, 2, 16, 512, False, 5e5, 1e-5, 32768, _LLAMA3_ROPE
    ),
}


class RandomWeights:
    """A `WeightSource` of random tensors for every parameter of `model_config`'s Kvasir model class.

    Norm weights are ones, biases zeros, everything else N(0, WEIGHT_STD); tensors are made on
    `device` in `dtype`, one at a time, and are the same on every iteration.
    """

    def __init__(self, model_config: Any, device: Any, dtype: Any, seed: int) -> None:
        import torch

        from kvasir.runtime.models.registry import get_model_class

        with torch.device("meta"):
            model = get_model_class(model_config.architecture)(model_config)
        # Checkpoint names (q_proj, not the merged qkv_proj); tied parameters appear once, as in a
        # checkpoint that does not repeat them.
        self.shapes = {name: tuple(t.shape) for name, t in model.checkpoint_tensors().items()}
        self.device, self.dtype, self.seed = device, dtype, seed

    @property
    def num_parameters(self) -> int:
        total = 0
        for shape in self.shapes.values():
            count = 1
            for size in shape:
                count *= size
            total += count
        return total

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        import torch

        for name, shape in self.shapes.items():
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith(".bias"):
                tensor.zero_()
            else:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
                tensor.normal_(0.0, WEIGHT_STD, generator=generator)
            yield name, tensor


def random_model_files(shape: ModelShape, device: Any, dtype: Any, seed: int) -> Any:
    """`ModelFiles` for `LLMEngine(config, files)`: the shape's config, a word-level tokenizer
    (token i is the word `t<i>`) and `RandomWeights`."""
    from kvasir.runtime.loader.hf_config import model_config_from_hf
    from kvasir.runtime.loader.model_files import ModelFiles
    from kvasir.runtime.loader.tokenizer import load_tokenizer

    model_config = model_config_from_hf(shape.hf_config().to_dict(), source=f"<{shape.label}>")
    with tempfile.TemporaryDirectory(prefix="kvasir-tokenizer-") as tmp:
        write_word_level_tokenizer(Path(tmp), shape.vocab_size)
        tokenizer = load_tokenizer(Path(tmp))
    return ModelFiles(
        config=model_config,
        tokenizer=tokenizer,
        source=Path(f"random-weights/{shape.label}"),
        weights=RandomWeights(model_config, device, dtype, seed),
    )


def hf_model_with_weights(shape: ModelShape, weights: RandomWeights) -> Any:
    """`AutoModelForCausalLM.from_config` on the weights' device and dtype, loaded with `weights`.

    Raises ValueError if the Hugging Face parameter names differ from the Kvasir ones.
    """
    import torch
    import transformers
    from packaging.version import Version

    # transformers 4.56 renamed `torch_dtype` to `dtype` (Qwen3 itself needs 4.51 or later).
    old_name = Version(transformers.__version__) < Version("4.56")
    dtype_kwarg = {"torch_dtype" if old_name else "dtype": weights.dtype}
    with torch.device(weights.device):
        model = transformers.AutoModelForCausalLM.from_config(shape.hf_config(), **dtype_kwarg)
    params = dict(model.named_parameters())
    if set(params) != set(weights.shapes):
        only_hf = sorted(set(params) - set(weights.shapes))[:5]
        only_kvasir = sorted(set(weights.shapes) - set(params))[:5]
        raise ValueError(
            f"parameter names differ: only in transformers {only_hf}, only in Kvasir {only_kvasir}"
        )
    with torch.no_grad():
        for name, tensor in weights.iter_weights():
            params[name].copy_(tensor)
    return model.eval()
