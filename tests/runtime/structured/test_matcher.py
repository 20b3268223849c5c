"""`GrammarState` (runtime/structured/matcher.py) against a reference written from the language:
for `[a-z ]{3,12}` a token is allowed after a prefix exactly when its text is letters and spaces
and the total stays within 12 characters, and EOS once there are at least 3. `fill_bitmask`'s
rows, drafts included, must equal that reference; filling with drafts must leave the state as it
was; rows after a refused draft allow everything; `valid_prefix` counts what the grammar takes.
A random walk under a JSON schema checks the draft rows against the masks seen when walking."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kvasir.runtime.structured.compiler import CompiledGrammar, GrammarCompiler
from kvasir.runtime.structured.matcher import GrammarState, bitmask_words
from kvasir.runtime.structured.params import StructuredOutputs
from tests.runtime.structured.support import json_spec
from tests.tiny_checkpoints import EOS_ID, IM_END_ID, SPECIAL_TOKENS, VOCAB_SIZE

ALPHABET = set("abcdefghijklmnopqrstuvwxyz ")
MIN_LEN, MAX_LEN = 3, 12
EOS = (EOS_ID, IM_END_ID)
WORDS = bitmask_words(VOCAB_SIZE)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint("llama") / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_str, VOCAB_SIZE, EOS)


@pytest.fixture(scope="module")
def letters(compiler: GrammarCompiler) -> CompiledGrammar:
    return compiler.compile(
        StructuredOutputs.regex(f"[a-z ]{{{MIN_LEN},{MAX_LEN}}}", "structured_outputs.regex")
    )


@pytest.fixture(scope="module")
def texts(tokenizer: Tokenizer) -> list[str]:
    """Each token's text ('\ufffd' for part of a UTF-8 character: never a letter)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in range(VOCAB_SIZE)]


def reference(texts: list[str], prefix: str) -> set[int]:
    """The tokens `[a-z ]{3,12}` allows after `prefix` (a prefix of the language)."""
    allowed = {
        t
        for t, text in enumerate(texts)
        if t >= len(SPECIAL_TOKENS) and text and set(text) <= ALPHABET and len(prefix) + len(text) <= MAX_LEN
    }
    return allowed | set(EOS) if len(prefix) >= MIN_LEN else allowed


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    return {int(t) for t in np.flatnonzero(bits)}


def ids(tokenizer: Tokenizer, *pieces: str) -> list[int]:
    out = []
    for piece in pieces:
        token = tokenizer.token_to_id(piece.replace(" ", "Ġ"))
        assert token is not None, piece
        out.append(token)
    return out


def fill(
    state: GrammarState, drafts: Sequence[int] = (), rows: int | None = None, first_row: int = 0
) -> np.ndarray:
    bitmask = np.zeros((rows or first_row + 1 + len(drafts), WORDS), dtype=np.int32)
    state.fill_bitmask(bitmask, first_row, drafts)
    return bitmask


def test_the_mask_is_the_language_s(letters, texts, tokenizer) -> None:
    state = letters.new_state()
    # Multi-character tokens matter: the vocabulary has words with and without a leading space.
    assert {"he", " the", " pick"} <= {texts[t] for t in reference(texts, "")}
    prefix = ""
    for piece in ("he", " wood", " s", "te", "a"):
        assert allowed(fill(state)[0]) == reference(texts, prefix), prefix
        (token,) = ids(tokenizer, piece)
        state.accept(token)
        prefix += piece
    assert prefix == "he wood stea" and len(prefix) == MAX_LEN
    assert allowed(fill(state)[0]) == set(EOS) and state.terminated
    assert state.num_accepted == 5


def test_drafts_fill_their_rows_and_leave_the_state_unchanged(letters, texts, tokenizer) -> None:
    state = letters.new_state()
    state.accept(ids(tokenizer, "a")[0])
    before = fill(state)[0].copy()
    drafts = ids(tokenizer, " the", " pick", "s")
    bitmask = fill(state, drafts)
    prefix = "a"
    for row, draft in enumerate([*drafts, None]):
        assert allowed(bitmask[row]) == reference(texts, prefix), (row, prefix)
        if draft is not None:
            prefix += texts[draft]
    # Rolled back exactly: same mask, same count, and the drafts can still be taken one by one.
    assert np.array_equal(fill(state)[0], before)
    assert state.num_accepted == 1 and not state.terminated
    assert state.valid_prefix(drafts) == len(drafts)
    for draft in drafts:
        state.accept(draft)
    assert not state.failed and allowed(fill(state)[0]) == reference(texts, "a the picks")


def test_rows_after_a_refused_draft_allow_everything(letters, texts, tokenizer) -> None:
    state = letters.new_state()
    refused = tokenizer.token_to_id("{")
    drafts = [*ids(tokenizer, "he"), refused, *ids(tokenizer, "a", "b")]
    bitmask = fill(state, drafts)
    assert allowed(bitmask[0]) == reference(texts, "")
    assert allowed(bitmask[1]) == reference(texts, "he")
    assert refused not in allowed(bitmask[1])
    # Row 2 scores the token after the refused draft: verification never reads it.
    assert (bitmask[2:] == -1).all()
    assert allowed(fill(state)[0]) == reference(texts, "") and state.num_accepted == 0


def test_drafts_past_the_end_of_the_grammar_are_refused(letters, texts, tokenizer) -> None:
    state = letters.new_state()
    drafts = ids(tokenizer, "he", " wood", " s", "te", "a", "a")  # 12 characters, then one too many
    assert state.valid_prefix(drafts) == 5
    bitmask = fill(state, drafts)
    assert allowed(bitmask[5]) == set(EOS)  # complete: only EOS after the fifth draft
    assert (bitmask[6:] == -1).all()
    assert state.num_accepted == 0 and allowed(fill(state)[0]) == reference(texts, "")


def test_fill_writes_only_its_own_rows(letters, texts, tokenizer) -> None:
    state = letters.new_state()
    drafts = ids(tokenizer, "he")
    bitmask = np.full((6, WORDS), 12345, dtype=np.int32)
    state.fill_bitmask(bitmask, 2, drafts)
    assert (bitmask[:2] == 12345).all() and (bitmask[4:] == 12345).all()
    assert allowed(bitmask[2]) == reference(texts, "") and allowed(bitmask[3]) == reference(texts, "he")


def test_valid_prefix_counts_without_changing_the_state(letters, tokenizer) -> None:
    state = letters.new_state()
    assert state.valid_prefix([]) == 0
    assert state.valid_prefix(ids(tokenizer, "he", " wood")) == 2
    assert state.valid_prefix([tokenizer.token_to_id("{"), *ids(tokenizer, "he")]) == 0
    assert state.valid_prefix([*ids(tokenizer, "he", "a"), EOS_ID]) == 3  # EOS ends an accepted output
    assert state.valid_prefix([*ids(tokenizer, "he"), EOS_ID]) == 1  # too short to end
    assert state.num_accepted == 0 and state.valid_prefix(ids(tokenizer, "he")) == 1


def test_a_refused_token_ends_the_sequence(letters, tokenizer) -> None:
    """The mask makes it impossible; were it to happen, the sequence stops (never runs free)."""
    state = letters.new_state()
    state.accept(tokenizer.token_to_id("{"))
    assert state.failed and state.terminated


def test_eos_ends_a_complete_output(letters, tokenizer) -> None:
    state = letters.new_state()
    for token in ids(tokenizer, "he", "a"):
        state.accept(token)
    assert not state.terminated
    state.accept(EOS_ID)
    assert state.terminated and not state.failed


def test_draft_rows_equal_the_masks_of_a_walk_under_a_json_schema(compiler: GrammarCompiler) -> None:
    """A random walk under a JSON schema records each position's mask; a second state then fills
    with the next tokens of the walk as drafts at every position, and each row must equal the
    recorded mask of its position (rollback exact: the row-0 masks stay right as it goes)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": 0, "maximum": 500},
            "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 3},
        },
        "required": ["name", "n", "tags"],
        "additionalProperties": False,
    }
    grammar = compiler.compile(json_spec(schema))
    rng = random.Random(7)
    for _ in range(5):
        walker = grammar.new_state()
        path: list[int] = []
        masks: list[np.ndarray] = []
        while not walker.terminated and len(path) < 80:
            mask = fill(walker)[0]
            masks.append(mask.copy())
            choices = sorted(allowed(mask) - set(EOS)) or sorted(allowed(mask))
            token = rng.choice(choices)
            walker.accept(token)
            path.append(token)
        masks.append(fill(walker)[0].copy())
        state = grammar.new_state()
        for position in range(len(path)):
            drafts = path[position : position + 3]
            bitmask = fill(state, drafts)
            for row in range(len(drafts) + 1):
                assert np.array_equal(bitmask[row], masks[position + row]), (position, row)
            state.accept(path[position])
        assert state.terminated == walker.terminated
