"""Tokenizers for the tool-call tests: one where every family's markers are special tokens, and the
embedded SmolLM2's, where none is (its vocabulary spells `<tool_call>` with several tokens)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.loader.tokenizer import Tokenizer

MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
EOS = "<|eot_id|>"


@pytest.fixture(scope="session")
def special_tokenizer() -> Tokenizer:
    """A tiny GPT-2-style byte-level BPE with the markers as added special tokens. Its few merges
    split most non-ASCII characters across tokens, so the UTF-8 hold-back is exercised."""
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', "The quick brown fox."] * 10
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, *MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return Tokenizer(backend, eos_token=EOS)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    try:
        return open_model(str(embedded_model_path())).tokenizer
    except ModelLoadError as error:
        pytest.skip(str(error))


@pytest.fixture(params=["special", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """Each tokenizer in turn: markers as single tokens, then markers as text."""
    name = "special_tokenizer" if request.param == "special" else "smollm2_tokenizer"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]
