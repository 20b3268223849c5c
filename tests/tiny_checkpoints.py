"""Tiny random-weight Hugging Face checkpoints of every supported family, written by `transformers`.

`make_tiny_checkpoint(path, family, **overrides)` writes config.json, safetensors weights (one file
or, with `sharded=True`, an index and several shards), generation_config.json, and a byte-level
BPE tokenizer with a chat template. Same arguments, same bytes: weights come from a fixed seed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 384
# Ids 0..3; prompts built from ids >= len(SPECIAL_TOKENS) never contain one.
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
}

# family -> (transformers config class, config fields on top of _COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama-gqa-llama3-rope": (
        "LlamaConfig",
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            # head_dim 16 at theta 10000 has wavelengths from 6 to ~20000: with an original context
            # of 64 the three llama3 regimes (kept, blended, divided) all occur.
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        {
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # Qwen3's head_dim is not hidden_size / num_heads (as in the real models).
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 3}),
}


def make_tiny_checkpoint(
    path: Path, family: str, *, sharded: bool = False, seed: int = 0, **overrides: Any
) -> Path:
    """Write a checkpoint of `family` (see FAMILIES) to `path`; `overrides` are config fields."""
    import transformers  # test-only dependency; imported here so importing this module is cheap

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    config_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**_COMMON, **fields, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    # 200 kB shards split even the smallest family into several files.
    model.save_pretrained(path, max_shard_size="200KB" if sharded else "1GB")
    eos_ids = [EOS_ID, IM_END_ID]
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": eos_ids, "do_sample": False}, indent=2)
    )
    (path / "tokenizer.json").write_text(_tokenizer_json(config.vocab_size))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[BOS_ID],
                "eos_token": SPECIAL_TOKENS[EOS_ID],
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": config.max_position_embeddings,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return path


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights loud enough that logits are far from flat (no greedy near-ties), norms and biases != 1/0.

    transformers' own init (std 0.02, norms 1, biases 0) would let a model that forgets to load a
    norm or a bias still match; these values make every parameter matter.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            elif name == "lm_head.weight":
                param.copy_(noise * (2.0 / param.shape[1] ** 0.5))
            else:  # a projection [out, in]: unit-variance outputs for unit-variance inputs
                param.copy_(noise / param.shape[1] ** 0.5)


# A fixed corpus: enough distinct words and pairs for BPE to learn well over 384 tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps near the warm fire.
A paged key value cache stores attention state in fixed size blocks of sixteen tokens.
Continuous batching lets new requests join a running batch at every single step.
The scheduler admits waiting requests until the token budget for the step is spent.
Prefix caching shares the blocks of a common system prompt between many requests.
When memory runs out the most recently admitted request is preempted and recomputed.
Kubernetes operators reconcile a desired state with the state observed in the cluster.
Autoscaling follows queue depth, cache usage and the ratio of tail to median latency.
def forward(self, input_ids, positions): return self.model(input_ids, positions)
for i in range(10): print(i * i, "squared", i ** 3, "cubed")
{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
Numbers like 0, 1, 2, 3, 42, 100, 2024 and 3.14159 appear in text all the time.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
How much wood would a woodchuck chuck if a woodchuck could chuck wood?
Peter Piper picked a peck of pickled peppers from the garden behind the house.
Rotary embeddings rotate query and key vectors by an angle that grows with position.
Grouped query attention lets several query heads share one key and value head.
Sliding window attention only looks back a fixed number of tokens from each position.
Greedy decoding always picks the token with the highest probability at every step.
"""


@lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE (GPT-2/Llama 3 style) with exactly `vocab_size` tokens, as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tiny corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}; lengthen it"
        )
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
            ),
        ]
    )
    return tokenizer.to_str()
