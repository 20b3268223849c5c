"""Incremental detokenization against real tokenizers: UTF-8 safety, stop strings, bounded work."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvasir.runtime.engine.output.detokenizer import IncrementalDetokenizer

TEXT = "Hello wörld, café 日本 🎉 stop here! The end."
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """A tiny GPT-2-style byte-level BPE: too few merges to keep 日本 or emoji in one token."""
    corpus = [
        "The quick brown fox jumps over the lazy dog. Hello world, this is a test of streaming.",
        "café résumé naïve",
        "日本語のテキスト",
        "emoji 🎉🚀 party",
    ] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for spaces, <0xNN> byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁abcdefghijklmnopqrstuvwxyzHTW,.!":
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)) -> list[str]:
    """Feed `ids` in chunks (cycling through chunk_sizes); return every update's text, then flush's."""
    chunks, start, turn = [], 0, 0
    while start < len(ids):
        size = chunk_sizes[turn % len(chunk_sizes)]
        chunks.append(detok.update(list(ids[start : start + size])))
        start, turn = start + size, turn + 1
    chunks.append(detok.flush())
    return chunks


def test_the_fixture_splits_multibyte_characters(byte_level: Tokenizer) -> None:
    pieces = [byte_level.decode([i]) for i in byte_level.encode(TEXT).ids]
    assert sum("\ufffd" in piece for piece in pieces) >= 4  # otherwise the tests below prove little


@pytest.mark.parametrize("chunk_sizes", [(1,), (2,), (3, 1, 4)])
@pytest.mark.parametrize("prompt", ["", "Say: "])
def test_streamed_text_equals_full_decode_without_broken_characters(
    byte_level: Tokenizer, chunk_sizes: tuple[int, ...], prompt: str
) -> None:
    ids = byte_level.encode(TEXT).ids
    detok = IncrementalDetokenizer(byte_level, byte_level.encode(prompt).ids)
    chunks = stream(detok, ids, chunk_sizes)
    assert "".join(chunks) == TEXT == detok.text
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert chunks[-1] == ""  # nothing was held: no stop strings


def test_invalid_bytes_come_out_as_in_the_full_decode(byte_level: Tokenizer) -> None:
    lone = [i for i in range(300) if byte_level.decode([i]) == "\ufffd"]  # single non-ASCII bytes
    assert lone
    ids = [*byte_level.encode("ok ").ids, lone[0], *byte_level.encode(" then").ids, lone[0]]
    detok = IncrementalDetokenizer(byte_level, [])
    chunks = stream(detok, ids)
    assert "".join(chunks) == byte_level.decode(ids)
    assert chunks[-1] == "\ufffd"  # the trailing incomplete byte is only released by flush


def test_byte_fallback_keeps_the_space_the_prompt_context_implies(byte_fallback: Tokenizer) -> None:
    prompt = byte_fallback.encode("say hi").ids
    output = byte_fallback.encode(" wörld 日本 ok").ids[1:]  # drop the normaliser's "▁" prefix
    full = byte_fallback.decode(prompt + output)
    prompt_text = byte_fallback.decode(prompt)
    assert full.startswith(prompt_text)
    chunks = stream(IncrementalDetokenizer(byte_fallback, prompt), output)
    assert "".join(chunks) == full[len(prompt_text) :] == " wörld 日本 ok"
    assert byte_fallback.decode(output) == "wörld 日本 ok"  # decoded alone, the space would be lost
    assert not any("\ufffd" in chunk for chunk in chunks)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_cut(byte_level: Tokenizer, include: bool) -> None:
    ids = byte_level.encode(TEXT).ids
    stop = "op he"
    assert stop not in [byte_level.decode([i]) for i in ids]  # it spans a token boundary
    detok = IncrementalDetokenizer(byte_level, [], stop=[stop, "never"], include_stop_str_in_output=include)
    released = ""
    for token in ids:
        released += detok.update([token])
        assert "op he" not in released or include
        if detok.stop_string_hit:
            break
    expected = TEXT[: TEXT.index(stop) + (len(stop) if include else 0)]
    assert detok.stop_string_hit == stop
    assert released == detok.text == expected
    assert detok.update(ids[-3:]) == "" and detok.flush() == ""


def test_stop_string_inside_a_multibyte_run(byte_level: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_level, [], stop=["日本"])
    assert "".join(stream(detok, byte_level.encode(TEXT).ids)) == "Hello wörld, café "
    assert detok.stop_string_hit == "日本"


def test_possible_stop_prefix_is_held_then_flushed(byte_level: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_level, [], stop=["The ends"])
    text = "Hello! The en"
    released = "".join(detok.update([token]) for token in byte_level.encode(text).ids)
    assert released == "Hello! "  # "The en" could still become "The ends"
    assert detok.flush() == "The en"
    assert detok.text == text and detok.stop_string_hit is None


def test_only_a_real_stop_prefix_is_held(byte_level: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_level, [], stop=["xyz!"])
    assert detok.update(byte_level.encode("Hello the").ids) == "Hello the"


def test_the_stop_completing_first_wins(byte_level: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_level, [], stop=["brown fox", "own"])
    assert detok.update(byte_level.encode("The quick brown fox").ids) == "The quick br"
    assert detok.stop_string_hit == "own"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_level: Tokenizer, skip: bool) -> None:
    end = byte_level.token_to_id("<|im_end|>")
    ids = [*byte_level.encode("Hi 日本").ids, end, *byte_level.encode(" bye").ids]
    detok = IncrementalDetokenizer(byte_level, [], skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == ("Hi 日本 bye" if skip else "Hi 日本<|im_end|> bye")


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_per_token_work_does_not_grow_with_the_output(byte_level: Tokenizer) -> None:
    counting = CountingTokenizer(byte_level)
    ids = byte_level.encode(TEXT * 30).ids
    detok = IncrementalDetokenizer(counting, ids[:50], stop=["zzz"])  # type: ignore[arg-type]
    assert "".join(stream(detok, ids)) == TEXT * 30
    assert len(counting.lengths) <= 2 * len(ids) + 1
    assert max(counting.lengths) <= 8  # a few context tokens plus at most one unfinished character


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stops_and_chunking_agree_with_a_reference(byte_level: Tokenizer, data: st.DataObject) -> None:
    """Whatever the chunking, output = full text cut at the first stop to complete (property test)."""
    starts = st.integers(0, len(TEXT) - 1)
    stops = data.draw(
        st.lists(st.tuples(starts, st.integers(1, 6)).map(lambda s: TEXT[s[0] : s[0] + s[1]]), max_size=3)
    )
    stops = [s for s in stops if s]
    include = data.draw(st.booleans())
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    hits = [(TEXT.index(s) + len(s), TEXT.index(s), s) for s in stops]
    first = min(hits, default=None)
    expected = TEXT if first is None else TEXT[: first[0] if include else first[1]]
    detok = IncrementalDetokenizer(byte_level, [], stop=stops, include_stop_str_in_output=include)
    chunks = stream(detok, byte_level.encode(TEXT).ids, sizes)
    assert "".join(chunks) == expected == detok.text
    assert detok.stop_string_hit == (None if first is None else first[2])
    assert not any("\ufffd" in chunk for chunk in chunks)
