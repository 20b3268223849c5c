"""Build a `Tokenizer` from GGUF metadata (`tokenizer.ggml.*`), as transformers' GGUF loader does.

A GGUF has no tokenizer.json: it stores the vocabulary, merges, token types and special ids under
llama.cpp's key names. Two vocabularies are supported: "gpt2" (byte-level BPE; the pre-tokenizer
flavour comes from `tokenizer.ggml.pre`) and "llama" (SentencePiece BPE with byte fallback; merges
are rebuilt from the token scores).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

# Split regexes of llama.cpp's `tokenizer.ggml.pre` flavours (applied before byte-level mapping).
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2"), (_GPT2,)),
    # Vocabularies trained on single digits: split every digit off first.
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2,)),
}
# Llama-3-style flavours: llama.cpp adds BOS when the file does not say, and ignores merges.
_LLAMA3_FLAVOURS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")


def tokenizer_from_gguf(meta: Mapping[str, Any], source: Path) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes; unsupported vocabularies are a ModelLoadError."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens in the GGUF metadata")
    token_types = list(meta.get("tokenizer.ggml.token_type") or [])
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if kind == "gpt2":
        backend = _byte_level(tokens, meta, pre, source)
        add_bos_default = pre in _LLAMA3_FLAVOURS
    elif kind == "llama":
        backend = _sentencepiece(tokens, meta, source)
        add_bos_default = True
    else:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    _add_special_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos_token, eos_token = token("bos_token_id"), token("eos_token_id")
    backend.post_processor = _bos_eos_post_processor(
        backend,
        bos_token,
        eos_token,
        bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    # End-of-turn / end-of-message ids (Llama 3's <|eot_id|>, <|eom_id|>) also end generation.
    eos_ids = [
        int(meta[f"tokenizer.ggml.{key}"])
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if meta.get(f"tokenizer.ggml.{key}") is not None
    ]
    return Tokenizer(
        backend,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=token("padding_token_id"),
        unk_token=token("unknown_token_id"),
        eos_token_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _bos_eos_post_processor(
    backend: BackendTokenizer, bos_token: str | None, eos_token: str | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """The post-processor transformers builds for explicit `add_bos_token`/`add_eos_token` flags."""
    bos = _known_token(backend, bos_token) if add_bos else None
    eos = _known_token(backend, eos_token) if add_eos else None
    single = f"{f'{bos[0]}:0 ' if bos else ''}$A:0{f' {eos[0]}:0' if eos else ''}"
    pair = f"{single}{f' {bos[0]}:1' if bos else ''} $B:1{f' {eos[0]}:1' if eos else ''}"
    special = [token for token in (bos, eos) if token is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _known_token(backend: BackendTokenizer, token: str | None) -> tuple[str, int] | None:
    token_id = None if token is None else backend.token_to_id(token)
    return None if token is None or token_id is None else (token, token_id)


def _byte_level(tokens: list[str], meta: Mapping[str, Any], pre: str, source: Path) -> BackendTokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError(f"{source}: a gpt2 tokenizer needs tokenizer.ggml.merges, which is missing")
    alphabet = _byte_alphabet()
    # Tokens are stored in the byte-level alphabet; respell any that are not (as transformers does).
    vocab = {
        (t if set(t) <= alphabet.keys() else "".join(_byte_to_char()[b] for b in t.encode())): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    # Llama 3's BPE takes a whole pre-token that is in the vocabulary as is (llama.cpp does too).
    ignore_merges = pre in _LLAMA3_FLAVOURS
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    splits = _SPLITS.get(pre)
    if splits is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; splitting text as GPT-2 does", source, pre)
        splits = (_GPT2,)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], meta: Mapping[str, Any], source: Path) -> BackendTokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: a llama (SentencePiece) tokenizer needs one score per token")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    pairs = (
        [tuple(m.split(" ", 1)) for m in merges]
        if merges
        else merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    )
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scored result first (ties: shorter left, then shorter right piece, then vocabulary order)."""
    candidates: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], *, byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so that
    text such as `<|im_start|>` maps to its one id instead of being cut into pieces."""
    alphabet = _byte_alphabet()
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)  # types may be absent
        # In a byte-level vocabulary a "control" token outside the alphabet is a converter mislabel.
        if kind == _CONTROL and (not byte_level or set(token) <= alphabet.keys())
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)  # types may be absent
        if kind == _USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)


@lru_cache(maxsize=1)
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    return {char: byte for byte, char in _byte_to_char().items()}
