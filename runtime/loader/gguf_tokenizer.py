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
    """The tokenizer a GGUF's metadata describes; unsupported vocabularies, and metadata of the wrong
    shape (a token list that is not strings, a special id outside the vocabulary), are a
    ModelLoadError naming the key."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = _strings(meta, "tokenizer.ggml.tokens", source)
    if not tokens:
        raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens in the GGUF metadata")
    token_types = _numbers(meta, "tokenizer.ggml.token_type", source, integers=True)
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    ids = {key: _token_id(meta, key, len(tokens), source) for key in _SPECIAL_IDS}
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ModelLoadError(
            f"{source}: tokenizer.chat_template must be a string, not {type(chat_template).__name__}"
        )
    try:
        if kind == "gpt2":
            backend = _byte_level(tokens, meta, pre, source)
            add_bos_default = pre in _LLAMA3_FLAVOURS
        else:
            backend = _sentencepiece(tokens, meta, ids["unknown_token_id"], source)
            add_bos_default = True
        _add_special_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")

        def token(key: str) -> str | None:
            index = ids[key]
            return None if index is None else tokens[index]

        bos_token, eos_token = token("bos_token_id"), token("eos_token_id")
        backend.post_processor = _bos_eos_post_processor(
            backend,
            bos_token,
            eos_token,
            bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        )
    except ModelLoadError:
        raise
    except Exception as error:  # tokenizers raises bare Exceptions for inconsistent vocabularies
        raise ModelLoadError(
            f"{source}: the GGUF tokenizer metadata does not make a tokenizer ({error})"
        ) from error
    # End-of-turn / end-of-message ids (Llama 3's <|eot_id|>, <|eom_id|>) also end generation.
    eos_ids = [
        index for key in ("eos_token_id", "eot_token_id", "eom_token_id") if (index := ids[key]) is not None
    ]
    return Tokenizer(
        backend,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=token("padding_token_id"),
        unk_token=token("unknown_token_id"),
        eos_token_ids=eos_ids,
        chat_template=chat_template,
    )


_SPECIAL_IDS = (
    "bos_token_id",
    "eos_token_id",
    "eot_token_id",
    "eom_token_id",
    "unknown_token_id",
    "padding_token_id",
)
# Deriving merges from scores tries every split of every token: the sum of the tokens' squared
# lengths bounds the work (about 10 million for real SentencePiece vocabularies).
MAX_MERGE_SEARCH = 200_000_000


def _strings(meta: Mapping[str, Any], key: str, source: Path) -> list[str]:
    """Metadata `key` as a list of strings ([] when absent)."""
    value = meta.get(key)
    if value is None and key in meta:  # GGUFFile reads arrays of arrays as None
        raise ModelLoadError(f"{source}: {key} must be an array of strings, not an array of arrays")
    if value is None:
        return []
    if not isinstance(value, list):
        raise ModelLoadError(f"{source}: {key} must be an array of strings, not {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise ModelLoadError(f"{source}: {key} must be an array of strings; item {index} is {item!r}")
    return value


def _numbers(meta: Mapping[str, Any], key: str, source: Path, *, integers: bool = False) -> list[Any]:
    """Metadata `key` as a list of numbers ([] when absent)."""
    value = meta.get(key)
    if value is None and key not in meta:
        return []
    kinds = (int,) if integers else (int, float)
    if not isinstance(value, list) or not all(
        isinstance(item, kinds) and not isinstance(item, bool) for item in value
    ):
        what = "integers" if integers else "numbers"
        raise ModelLoadError(f"{source}: {key} must be an array of {what}")
    return value


def _token_id(meta: Mapping[str, Any], key: str, vocab: int, source: Path) -> int | None:
    """`tokenizer.ggml.<key>`: None when absent, else an id inside the vocabulary (a padding id
    outside it, which some converters write, is ignored: nothing is looked up by it)."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab:
        return value
    if key == "padding_token_id":
        logger.warning("%s: tokenizer.ggml.%s %r is not a token id; ignored", source, key, value)
        return None
    raise ModelLoadError(
        f"{source}: tokenizer.ggml.{key} is {value!r}, not a token id of the {vocab:,} in tokenizer.ggml.tokens"
    )


def _merge_pairs(merges: list[str], source: Path) -> list[tuple[str, str]]:
    pairs = []
    for index, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space:
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.merges item {index} ({merge[:40]!r}) is not two tokens "
                "separated by a space"
            )
        pairs.append((left, right))
    return pairs


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
    merges = _strings(meta, "tokenizer.ggml.merges", source)
    if not merges:
        raise ModelLoadError(f"{source}: a gpt2 tokenizer needs tokenizer.ggml.merges, which is missing")
    alphabet = _byte_alphabet()
    # Tokens are stored in the byte-level alphabet; respell any that are not (as transformers does).
    vocab = {
        (t if set(t) <= alphabet.keys() else "".join(_byte_to_char()[b] for b in t.encode())): i
        for i, t in enumerate(tokens)
    }
    pairs = _merge_pairs(merges, source)
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


def _sentencepiece(
    tokens: list[str], meta: Mapping[str, Any], unk_id: int | None, source: Path
) -> BackendTokenizer:
    scores = _numbers(meta, "tokenizer.ggml.scores", source)
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: a llama (SentencePiece) tokenizer needs one score per token")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _strings(meta, "tokenizer.ggml.merges", source)
    if merges:
        pairs = _merge_pairs(merges, source)
    else:
        work = sum(len(token) ** 2 for token in tokens)
        if work > MAX_MERGE_SEARCH:
            raise ModelLoadError(
                f"{source}: tokens too long to derive merges from their scores (the sum of their "
                f"squared lengths is {work:,}, over {MAX_MERGE_SEARCH:,}); no real vocabulary comes close"
            )
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    unk = tokens[unk_id] if unk_id is not None else None
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
