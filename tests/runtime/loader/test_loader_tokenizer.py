"""Tokenizer wrapper and chat templates; a SentencePiece ("llama") GGUF vocabulary against transformers."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from kvasir.runtime.loader.chat_template import ChatTemplateError
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.loader.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Hi <b>&</b> ünï"}]


def _word_tokenizer(chat_template: str | None) -> Tokenizer:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(
        backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=chat_template
    )


def _render(template: str, messages: list[dict[str, Any]] = USER, **kwargs: Any) -> str:
    return _word_tokenizer(template).apply_chat_template(messages, **kwargs)


def test_template_sees_tokens_flags_and_transformers_helpers() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}={{ m | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}|gen|{% endif %}{{ eos_token }}{{ extra }}"
    )
    rendered = _render(template, extra="!")
    # tojson keeps <, >, & and non-ASCII as is (Jinja's own filter would HTML-escape them).
    assert rendered == '<s>user={"role": "user", "content": "Hi <b>&</b> ünï"}|gen|</s>!'
    assert "|gen|" not in _render(template, add_generation_prompt=False, extra="")
    before = datetime.date.today().isoformat()
    rendered = _render("{{ strftime_now('%Y-%m-%d') }}")
    assert rendered in {before, datetime.date.today().isoformat()}  # a midnight in between is fine


def test_trim_and_lstrip_blocks_like_transformers() -> None:
    template = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[{{ m['content'] }}]\n    {% endif %}\n{% endfor %}"
    assert (
        _render(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "[a]\n[b]\n"
    )


def test_loop_controls_and_namespace_work() -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{% if ns.n > 1 %}{% break %}{% endif %}{{ m['content'] }}"
        "{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "user", "content": "u2"},
    ]
    assert _render(template, messages) == "u1"


def test_raise_exception_becomes_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        _render("{{ raise_exception('roles must alternate') }}")


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.append(1) }}",  # the sandbox is immutable
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",  # underscore names are refused
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        _render(template)


def test_missing_or_broken_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _word_tokenizer(None).apply_chat_template(USER)
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        _render("{% for m in messages %}")


def test_wrapper_properties() -> None:
    tokenizer = _word_tokenizer(None)
    assert tokenizer.encode("hello world") == [3, 4]
    assert tokenizer.decode([0, 3, 4, 1]) == "hello world"
    assert tokenizer.decode([0, 3, 1], skip_special_tokens=False) == "<s> hello </s>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size) == (0, (1,), 5)
    assert tokenizer.all_special_ids == [0, 1, 2]


# --- A SentencePiece vocabulary in a GGUF, tokenized by us and by transformers' GGUF loader. ---

SPM_PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "a", "n", "é", "c", "f", "i", "s",
              "ll", "he", "▁h", "▁w", "or", "ld", "▁the", "th", "▁t", "hel", "llo", "▁hello", "▁wor", "▁world",
              "an", "▁an", "▁and", "ca", "▁ca", "fé", "▁café", "in", "is", "▁is", "▁▁", "▁▁▁▁"]  # fmt: skip
SPM_TEXTS = ["hello world", "Hello World", "the café is open", "  two  spaces", "tabs\tand\nnewlines",
             "emoji 🙂 and 日本", "<|user|>hello<|end|>", "hello <think>and</think>", ""]  # fmt: skip


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    tokens += ["<|user|>", "<|end|>", "<think>", "</think>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    types += [TokenType.NORMAL] * len(SPM_PIECES) + [TokenType.CONTROL] * 2 + [TokenType.USER_DEFINED] * 2
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0] * 4
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, 1), (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
        (writer.add_head_count, 2), (writer.add_context_length, 64), (writer.add_vocab_size, len(tokens)),
    ]:  # fmt: skip
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_tokenizer_matches_transformers(spm_gguf: Path, text: str) -> None:
    from transformers import AutoTokenizer

    ours = GGUFCheckpoint(spm_gguf).tokenizer()
    theirs = AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ids[:1] == [1]  # llama vocabularies add BOS unless the file says otherwise
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_unsupported_gguf_tokenizer_model_is_named(spm_gguf: Path) -> None:
    checkpoint = GGUFCheckpoint(spm_gguf)
    metadata = {**checkpoint.metadata, "tokenizer.ggml.model": "t5"}
    from kvasir.runtime.loader.gguf_tokenizer import tokenizer_from_gguf

    with pytest.raises(
        ModelLoadError, match=r"tokenizer\.ggml\.model 't5' is not supported; supported: gpt2, llama"
    ):
        tokenizer_from_gguf(metadata, spm_gguf)
