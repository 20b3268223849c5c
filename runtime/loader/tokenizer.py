"""The runtime's tokenizer: a `tokenizers.Tokenizer` plus BOS/EOS rules and the chat template.

`load_tokenizer` reads a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`, EOS ids
from `generation_config.json` and `config.json`); `gguf_tokenizer` builds one from GGUF metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from kvasir.runtime.loader.chat_template import ChatTemplateError, render_chat_template
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.json_files import read_optional_json_object


class Tokenizer:
    """Text <-> token ids for one model, and its chat template; thread-safe for encode/decode."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        eos_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if not eos_ids and eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids = (eos_id,)
        self._eos_token_ids = eos_ids
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        for name in (bos_token, eos_token, pad_token, unk_token):
            if name is not None and (token_id := backend.token_to_id(name)) is not None:
                special.add(token_id)
        self._special_ids = frozenset(special | set(eos_ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (the EOS token and e.g. `<|eot_id|>`), in config order."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included); may be < the model's."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of special added tokens and of the named BOS/EOS/PAD/UNK tokens, sorted."""
        return sorted(self._special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: the longest vocabulary entry (byte-level
        entries spell one character per byte, SentencePiece ones one per character, so no token
        decodes to more characters than its entry has)."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the BOS/EOS the model expects are added."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; `skip_special_tokens` drops every id in `all_special_ids`."""
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """The prompt token ids for `messages`: the template writes the special tokens (BOS and the
        role markers) itself, so encoding adds none; adding them again would double the BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages`; raises ChatTemplateError if there is no template."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; use a completion request, or a model whose tokenizer "
                "config (or GGUF metadata) carries a chat_template"
            )
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "tools": None,
            "documents": None,
            **kwargs,
        }
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables
        )


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder; needs `tokenizer.json` (a "fast" tokenizer)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{path}: not found; only Hugging Face 'fast' tokenizers (tokenizer.json) are supported"
        )
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises bare Exception for malformed files
        raise ModelLoadError(f"{path}: cannot be parsed as a tokenizer ({error})") from error

    config = read_optional_json_object(folder / "tokenizer_config.json")
    bos_token = _token_text(config.get("bos_token"))
    eos_token = _token_text(config.get("eos_token"))
    # BOS/EOS insertion is tokenizer.json's post-processor alone: like transformers 5, we ignore
    # tokenizer_config's add_bos_token/add_eos_token when a tokenizer.json exists.
    eos_ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos_ids.extend(_as_ids(read_optional_json_object(folder / name).get("eos_token_id")))
    return Tokenizer(
        backend,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=_token_text(config.get("pad_token")),
        unk_token=_token_text(config.get("unk_token")),
        eos_token_ids=eos_ids,
        chat_template=_chat_template(folder, config),
    )


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (transformers' current format) or tokenizer_config's `chat_template`."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
