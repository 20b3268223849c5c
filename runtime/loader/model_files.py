"""The loader's front door: `--model X` in, a config, a tokenizer and a weight iterator out."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvasir.runtime.config import EngineConfig, ModelConfig
from kvasir.runtime.layers.quantization.weights import QuantizedWeight
from kvasir.runtime.loader.chat_template import ChatTemplateError, ChatTemplateLimitError
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.loader.hf_config import model_config_from_hf
from kvasir.runtime.loader.hf_quantized import hf_quantized_weights, logical_shapes
from kvasir.runtime.loader.json_files import read_json_object
from kvasir.runtime.loader.quantization import Quantization, declared_hf_quantization, resolve_quantization
from kvasir.runtime.loader.safetensors_weights import SafetensorsWeights
from kvasir.runtime.loader.source import resolve_model_source
from kvasir.runtime.loader.tensor_index import check_tensor_index
from kvasir.runtime.loader.tokenizer import Tokenizer, load_tokenizer
from kvasir.runtime.parallel.partition import ShardMap

logger = logging.getLogger(__name__)


# A checkpoint weight as the loader hands it over: a float tensor, or a quantized one kept packed.
Weight = torch.Tensor | QuantizedWeight


class WeightSource(Protocol):
    """Something that yields a checkpoint's `(hf_name, weight)` pairs, one tensor at a time;
    with `shards` (tensor parallelism), a sharded weight as this rank's slice alone."""

    def iter_weights(self, shards: ShardMap | None = None) -> Iterator[tuple[str, Weight]]: ...


@dataclass(frozen=True)
class ModelFiles:
    """A checked checkpoint: its shape, its tokenizer, and its weights (read on demand)."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: Path
    weights: WeightSource = dataclasses.field(repr=False, compare=False)
    # How the weights are stored and run (`config.quantization` holds the same method).
    quantization: Quantization = dataclasses.field(default_factory=lambda: Quantization(None))

    def iter_weights(self, shards: ShardMap | None = None) -> Iterator[tuple[str, Weight]]:
        """Hugging Face names with float tensors in their stored dtype, or `QuantizedWeight`s for
        the weights a quantized checkpoint keeps packed (see docs/quantization.md). With `shards`
        (name -> this rank's slice) each sharded weight is read as that slice only."""
        if shards is None:
            return self.weights.iter_weights()
        return self.weights.iter_weights(shards)


def open_model(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
    quantization: str | None = None,
) -> ModelFiles:
    """Resolve `model` (folder, .gguf file or hub id), check its files, read config and tokenizer.

    `quantization` is `--quantization`: None takes what the checkpoint declares."""
    source = resolve_model_source(model, revision=revision, download_dir=download_dir, token=token)
    return open_local_model(source, quantization=quantization)


def open_engine_model(config: EngineConfig) -> ModelFiles:
    """`open_model` with the engine's settings (its model, revision, download folder, token and
    `--quantization`), checked against them before anything is allocated: one sequence of the
    context length must fit the KV cache's budget (`check_context_fits`), and the model is built for
    no more positions than the engine will use (its rotary table is sized by them)."""
    files = open_model(
        config.model,
        revision=config.revision,
        download_dir=config.download_dir,
        token=config.hf_token,
        quantization=config.quantization,
    )
    check_context_fits(config, files)
    context = config.context_length(files.config)
    if context < files.config.max_position_embeddings:
        model = dataclasses.replace(files.config, max_position_embeddings=context)
        files = dataclasses.replace(files, config=model)
    return files


# The fewest bytes a KV-cache element can take under each --kv-cache-dtype ("auto" picks float16 or
# the model's dtype: never fewer than 2 bytes).
_KV_ELEMENT_BYTES = {"fp8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "auto": 2}


def check_context_fits(config: EngineConfig, files: ModelFiles) -> None:
    """ModelLoadError when one sequence of the context length cannot fit the KV cache the engine
    would allocate, whatever it picks: the engine refuses that after loading the weights, and a
    context length in the hundreds of millions (a GGUF's context_length of 2**28) would size
    tables from it before. The bound errs towards letting the engine decide: the smallest element
    size the settings allow, and on a GPU the memory free before the weights load. Under tensor
    parallelism each rank's budget holds only its KV heads."""
    context = config.context_length(files.config)
    needed = -(-context // config.block_size)
    if config.num_kv_blocks is not None:
        blocks, budget_source = config.num_kv_blocks, "--num-kv-blocks"
    else:
        budget, budget_source = _kv_budget(config)
        if budget is None:
            return
        # Each rank's budget holds its own KV heads (one at least: fewer than ranks are replicated).
        kv_heads = files.config.num_key_value_heads
        rank_heads = max(kv_heads // config.tensor_parallel_size, 1)
        elements = files.config.kv_elements_per_token // kv_heads * rank_heads
        per_token = elements * _KV_ELEMENT_BYTES.get(config.kv_cache_dtype, 1)
        blocks = budget // (per_token * config.block_size)
    if blocks >= needed:
        return
    length = "--max-model-len" if config.max_model_len else "the model's context length"
    raise ModelLoadError(
        f"{files.source}: one sequence of {context:,} tokens ({length}) needs {needed:,} KV-cache blocks "
        f"of {config.block_size} tokens, and {budget_source} holds at most {blocks:,}; lower "
        "--max-model-len or give the KV cache more memory"
    )


def _kv_budget(config: EngineConfig) -> tuple[int | None, str]:
    """The most bytes the KV cache could get (None: unknown here), and the setting that sets it."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return config.kv_cache_bytes, "--kv-cache-bytes"
    if not torch.cuda.is_available():
        return None, ""  # the engine reports the missing device itself
    free_bytes, _total = torch.cuda.mem_get_info()
    return int(
        free_bytes * config.kv_cache_memory_fraction
    ), "--kv-cache-memory-fraction of the free GPU memory"


def open_local_model(path: Path, *, quantization: str | None = None) -> ModelFiles:
    """A local Hugging Face folder, a .gguf file, or a folder holding exactly one .gguf file."""
    if path.is_file():
        return _open_gguf(path, quantization)
    config_path = path / "config.json"
    if config_path.is_file():
        return _open_hf_folder(path, config_path, quantization)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _open_gguf(ggufs[0], quantization)
    if ggufs:
        raise ModelLoadError(
            f"{path}: holds several GGUF files ({', '.join(p.name for p in ggufs)}); pass one of them"
        )
    raise ModelLoadError(f"{config_path}: not found; {path} is not a Hugging Face model folder")


def _open_hf_folder(folder: Path, config_path: Path, requested: str | None) -> ModelFiles:
    hf_config = read_json_object(config_path)
    config = model_config_from_hf(hf_config, source=str(config_path))
    quantization = resolve_quantization(
        requested, declared_hf_quantization(hf_config, str(config_path)), str(folder)
    )
    stored = SafetensorsWeights.from_folder(folder)
    packed = quantization.method if not quantization.at_load else None
    check_tensor_index(config, logical_shapes(packed, stored.shapes), str(config_path))
    weights: WeightSource = stored
    if packed is not None:
        weights = hf_quantized_weights(packed, stored, hf_config, config_path)
    tokenizer = load_tokenizer(folder)
    return _files(config, tokenizer, folder, weights, quantization)


def _open_gguf(path: Path, requested: str | None) -> ModelFiles:
    quantization = resolve_quantization(requested, "gguf", str(path))
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    checkpoint.check_tensor_index(config)
    return _files(config, checkpoint.tokenizer(), path, checkpoint, quantization)


def check_chat_template(tokenizer: Tokenizer, source: Path) -> None:
    """Render the chat template once for a one-message chat: a template that cannot do that within
    its bounds (its loops never end, it builds gigabytes) would fail every chat request after a
    second of work each, so the model is refused now (ModelLoadError). A template that fails in
    another way (a syntax error, `raise_exception` for this chat) is only logged: completions still
    work, and chat requests get its error as a 400."""
    if not tokenizer.chat_template:
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    except ChatTemplateLimitError as error:
        reason = str(error).removeprefix("chat template: ")
        raise ModelLoadError(
            f"{source}: the chat template cannot render a one-message chat: {reason}"
        ) from error
    except ChatTemplateError as error:
        logger.warning("%s: the chat template fails on a one-message chat: %s", source, error)


def _files(
    config: ModelConfig,
    tokenizer: Tokenizer,
    source: Path,
    weights: WeightSource,
    quantization: Quantization,
) -> ModelFiles:
    # The tokenizer's EOS set already merges generation_config.json and config.json.
    config = dataclasses.replace(
        config,
        quantization=quantization.method,
        eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids,
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id,
    )
    check_chat_template(tokenizer, source)
    if tokenizer.vocab_size > config.vocab_size:
        logger.warning(
            "%s: the tokenizer knows %d tokens but the model embeds only %d; ids past that will fail",
            source,
            tokenizer.vocab_size,
            config.vocab_size,
        )
    return ModelFiles(
        config=config, tokenizer=tokenizer, source=source, weights=weights, quantization=quantization
    )
