"""The loader's front door: `--model X` in, a config, a tokenizer and a weight iterator out."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.loader.hf_config import model_config_from_hf
from kvasir.runtime.loader.json_files import read_json_object
from kvasir.runtime.loader.safetensors_weights import SafetensorsWeights
from kvasir.runtime.loader.source import resolve_model_source
from kvasir.runtime.loader.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Something that yields a checkpoint's `(hf_name, tensor)` pairs, one tensor at a time."""

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class ModelFiles:
    """A checked checkpoint: its shape, its tokenizer, and its weights (read on demand)."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: Path
    weights: WeightSource = dataclasses.field(repr=False, compare=False)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face names with tensors in their stored dtype (float32 for a dequantized GGUF)."""
        return self.weights.iter_weights()


def open_model(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | None = None,
) -> ModelFiles:
    """Resolve `model` (folder, .gguf file or hub id), check its files, read config and tokenizer."""
    source = resolve_model_source(model, revision=revision, download_dir=download_dir, token=token)
    return open_local_model(source)


def open_local_model(path: Path) -> ModelFiles:
    """A local Hugging Face folder, a .gguf file, or a folder holding exactly one .gguf file."""
    if path.is_file():
        return _open_gguf(path)
    config_path = path / "config.json"
    if config_path.is_file():
        return _open_hf_folder(path, config_path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _open_gguf(ggufs[0])
    if ggufs:
        raise ModelLoadError(
            f"{path}: holds several GGUF files ({', '.join(p.name for p in ggufs)}); pass one of them"
        )
    raise ModelLoadError(f"{config_path}: not found; {path} is not a Hugging Face model folder")


def _open_hf_folder(folder: Path, config_path: Path) -> ModelFiles:
    config = model_config_from_hf(read_json_object(config_path), source=str(config_path))
    weights = SafetensorsWeights.from_folder(folder)
    tokenizer = load_tokenizer(folder)
    return _files(config, tokenizer, folder, weights)


def _open_gguf(path: Path) -> ModelFiles:
    checkpoint = GGUFCheckpoint(path)
    return _files(checkpoint.model_config(), checkpoint.tokenizer(), path, checkpoint)


def _files(config: ModelConfig, tokenizer: Tokenizer, source: Path, weights: WeightSource) -> ModelFiles:
    # The tokenizer's EOS set already merges generation_config.json and config.json.
    config = dataclasses.replace(
        config,
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
    return ModelFiles(config=config, tokenizer=tokenizer, source=source, weights=weights)
