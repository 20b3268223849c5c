"""The embedded SmolLM2 GGUF: our weights, tokenizer and chat template equal transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kvasir.runtime.layers.quantization.gguf import GGUFWeight
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.loader.model_files import ModelFiles, open_model
from tests.hf_reference import gguf_parsed_once

pytestmark = pytest.mark.slow  # transformers' GGUF loader needs ~25 s for model + tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "héllo wörld — naïve café, Straße, Ærø",
    "日本語のテキストと中文字符，한국어",
    "emoji: 🙂👍🏽 🇳🇴 👨‍👩‍👧",
    "   leading spaces, double  spaces,\ttabs\t\tand\n\nnewlines\r\n  ",
    "def f(x):\n    return x**2  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text between<|im_end|>",
    "",
    " ",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke 🙂"},
    ],
]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return embedded_model_path()
    except ModelLoadError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def ours(gguf_path: Path) -> ModelFiles:
    return open_model(str(gguf_path))


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path) -> Any:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_state(hf_model: Any) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}


def test_every_weight_equals_transformers_dequantized(
    ours: ModelFiles, hf_state: dict[str, torch.Tensor]
) -> None:
    seen = set()
    for name, weight in ours.iter_weights():
        seen.add(name)
        # Packed matrices are compared through our own block decoder (gguf_blocks), not gguf-py's.
        tensor = weight.dequantize() if isinstance(weight, GGUFWeight) else weight
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, hf_state[name]), name
    # The checkpoint ties lm_head to the embedding; transformers lists it, we leave it to the model.
    assert seen == set(hf_state) - {"lm_head.weight"}
    assert (
        "model.layers.0.self_attn.q_proj.weight" in seen and "model.layers.29.self_attn.k_proj.weight" in seen
    )


def test_q_and_k_really_needed_unpermuting(ours: ModelFiles, hf_state: dict[str, torch.Tensor]) -> None:
    # Guards the test above: the stored rows differ from Hugging Face's, so equality proves the un-permute.
    assert isinstance(ours.weights, GGUFCheckpoint)
    tensors = {t.name: t for t in ours.weights.file.tensors}
    for gguf_name, hf_name in [("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")]:
        stored = dequantize(tensors[gguf_name].data, tensors[gguf_name].tensor_type)
        expected = hf_state[f"model.layers.0.self_attn.{hf_name}.weight"].numpy()
        assert stored.shape == expected.shape and not np.array_equal(stored, expected)


def test_config_matches_transformers(ours: ModelFiles, hf_model: Any) -> None:
    hf = hf_model.config
    config = ours.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
    )
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.head_dim == hf.head_dim and config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.eos_token_ids == ours.tokenizer.eos_token_ids == (hf.eos_token_id,)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours: ModelFiles, hf_tokenizer: Any, text: str) -> None:
    tokenizer = ours.tokenizer
    for special in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=special)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_special_tokens_match_transformers(ours: ModelFiles, hf_tokenizer: Any) -> None:
    tokenizer = ours.tokenizer
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.eos_token_ids == (hf_tokenizer.eos_token_id,)
    assert tokenizer.vocab_size == len(hf_tokenizer)
    # transformers lists only the named tokens; we also list the control tokens it adds as special.
    assert set(hf_tokenizer.all_special_ids) <= set(tokenizer.all_special_ids)
    hf_special = {i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
    assert set(tokenizer.all_special_ids) == hf_special
    assert tokenizer.encode("<|im_start|>") == [tokenizer.token_to_id("<|im_start|>")]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: ModelFiles, hf_tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    rendered = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt
