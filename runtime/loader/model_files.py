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
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.loader.hf_config import model_config_from_hf
from kvasir.runtime.loader.hf_quantized import hf_quantized_weights
from kvasir.runtime.loader.json_files import read_json_object
from kvasir.runtime.loader.quantization import Quantization, declared_hf_quantization, resolve_quantization
from kvasir.runtime.loader.safetensors_weights import SafetensorsWeights
from kvasir.runtime.loader.source import resolve_model_source
from kvasir.runtime.loader.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


# A checkpoint weight as the loader hands it over: a float tensor, or a quantized one kept packed.
Weight = torch.Tensor | QuantizedWeight


class WeightSource(Protocol):
    """Something that yields a checkpoint's `(hf_name, weight)` pairs, one tensor at a time."""

    def iter_weights(self) -> Iterator[tuple[str, Weight]]: ...


@dataclass(frozen=True)
class ModelFiles:
    """A checked checkpoint: its shape, its tokenizer, and its weights (read on demand)."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: Path
    weights: WeightSource = dataclasses.field(repr=False, compare=False)
    # How the weights are stored and run (`config.quantization` holds the same method).
    quantization: Quantization = dataclasses.field(default_factory=lambda: Quantization(None))

    def iter_weights(self) -> Iterator[tuple[str, Weight]]:
        """Hugging Face names with float tensors in their stored dtype, or `QuantizedWeight`s for
        the weights a quantized checkpoint keeps packed (see docs/quantization.md)."""
        return self.weights.iter_weights()


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
    `--quantization`)."""
    return open_model(
        config.model,
        revision=config.revision,
        download_dir=config.download_dir,
        token=config.hf_token,
        quantization=config.quantization,
    )


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
    weights: WeightSource = SafetensorsWeights.from_folder(folder)
    if quantization.method is not None and not quantization.at_load:
        weights = hf_quantized_weights(quantization.method, weights, hf_config, config_path)
    tokenizer = load_tokenizer(folder)
    return _files(config, tokenizer, folder, weights, quantization)


def _open_gguf(path: Path, requested: str | None) -> ModelFiles:
    quantization = resolve_quantization(requested, "gguf", str(path))
    checkpoint = GGUFCheckpoint(path)
    return _files(checkpoint.model_config(), checkpoint.tokenizer(), path, checkpoint, quantization)


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
