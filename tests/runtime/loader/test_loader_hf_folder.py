"""Hugging Face folders: config, safetensors (single and sharded), tokenizer files, and their errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import ModelFiles, open_model

CORPUS = ["Hello world, hello there.", "The quick brown fox jumps over the lazy dog.", "日本語 🙂 café"] * 4
SPECIALS = ["<s>", "</s>", "<|eot|>"]
TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _write_tokenizer(folder: Path) -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    backend.save(str(folder / "tokenizer.json"))
    return backend


def _write_folder(folder: Path, *, shard_size: str | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random Llama saved by transformers, with a tokenizer trained here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    backend = _write_tokenizer(folder)
    eos, eot = backend.token_to_id("</s>"), backend.token_to_id("<|eot|>")
    config = LlamaConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=backend.token_to_id("<s>"),
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    kwargs: dict[str, Any] = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, eos]}))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "add_bos_token": False,  # ignored next to tokenizer.json, by transformers 5 and by us
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder, {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    return _write_folder(tmp_path_factory.mktemp("single") / "model")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    return _write_folder(tmp_path_factory.mktemp("sharded") / "model", shard_size="30KB")


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _assert_weights(files: ModelFiles, expected: dict[str, torch.Tensor]) -> None:
    loaded = dict(files.iter_weights())
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16, name  # stored dtype, not upcast
        assert torch.equal(tensor, expected[name]), name


def test_single_file_folder_loads_config_weights_tokenizer(single: tuple[Path, dict]) -> None:
    folder, expected = single
    files = open_model(str(folder))
    assert (folder / "model.safetensors").is_file()
    assert files.source == folder
    config = files.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (32, 4, 2)
    assert not config.tie_word_embeddings
    _assert_weights(files, expected)


def test_sharded_folder_reads_every_shard(sharded: tuple[Path, dict]) -> None:
    folder, expected = sharded
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    _assert_weights(open_model(str(folder)), expected)


def test_eos_ids_merge_generation_config_then_config(single: tuple[Path, dict]) -> None:
    folder, _ = single
    files = open_model(str(folder))
    eot, eos = files.tokenizer.token_to_id("<|eot|>"), files.tokenizer.token_to_id("</s>")
    assert files.tokenizer.eos_token_ids == (eot, eos)
    assert files.config.eos_token_ids == (eot, eos)


def test_tokenizer_matches_transformers_on_the_same_folder(single: tuple[Path, dict]) -> None:
    from transformers import AutoTokenizer

    folder, _ = single
    ours = open_model(str(folder)).tokenizer
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in [*CORPUS[:3], "  spaced  out\n", "<s>literal</s> specials<|eot|>"]:
        ids = ours.encode(text)
        assert ids[0] == ours.bos_token_id  # tokenizer.json's post-processor adds it
        assert ids == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_chat_template_jinja_file_wins_over_tokenizer_config(
    single: tuple[Path, dict], tmp_path: Path
) -> None:
    folder = _copy(single[0], tmp_path)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tokenizer = open_model(str(folder)).tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"


def test_missing_shard_is_named(sharded: tuple[Path, dict], tmp_path: Path) -> None:
    folder = _copy(sharded[0], tmp_path)
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"shard.*do not exist: {victim.name}"):
        open_model(str(folder))


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_truncated_safetensors_is_named(which: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    folder = _copy(request.getfixturevalue(which)[0], tmp_path)
    victim = sorted(folder.glob("model*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=f"{victim.name}: corrupt or truncated"):
        open_model(str(folder))


def test_unknown_architecture_names_it_and_the_file(single: tuple[Path, dict], tmp_path: Path) -> None:
    folder = _copy(single[0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ModelLoadError, match=r"config\.json: architecture 'GPT2LMHeadModel' is not supported"
    ):
        open_model(str(folder))


def test_missing_config_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: not found"):
        open_model(str(tmp_path))


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "model.safetensors.index.json"])
def test_corrupt_json_is_named(name: str, sharded: tuple[Path, dict], tmp_path: Path) -> None:
    folder = _copy(sharded[0], tmp_path)
    (folder / name).write_text("{not json")
    with pytest.raises(ModelLoadError, match=rf"{name}: not valid JSON"):
        open_model(str(folder))


def test_no_weights_says_what_was_found(single: tuple[Path, dict], tmp_path: Path) -> None:
    folder = _copy(single[0], tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no weights.*found pytorch_model\.bin"):
        open_model(str(folder))


def test_missing_tokenizer_json_is_named(single: tuple[Path, dict], tmp_path: Path) -> None:
    folder = _copy(single[0], tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not found"):
        open_model(str(folder))
