"""Weights of a Hugging Face folder: `model.safetensors` or the shards a `.index.json` lists.

Under tensor parallelism a rank reads only its slice of each sharded tensor (`get_slice`: the
bytes of the other ranks' rows or columns are never copied out of the memory-mapped file)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.json_files import read_json_object
from kvasir.runtime.parallel.partition import ShardMap, TensorShard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SafetensorsWeights:
    """The checked list of safetensors files of one checkpoint, read lazily one tensor at a time."""

    files: tuple[Path, ...]
    # Every tensor's name and shape, from the files' headers (no tensor data read).
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_folder(cls, folder: Path) -> SafetensorsWeights:
        """Find the weight files and check that each exists and has a readable header."""
        index = folder / INDEX_FILE
        if index.is_file():
            files = _shards_from_index(index)
        elif (folder / SINGLE_FILE).is_file():
            files = {folder / SINGLE_FILE: set[str]()}
        else:
            raise ModelLoadError(_no_weights_message(folder))
        shapes: dict[str, tuple[int, ...]] = {}
        for file, expected in files.items():
            found = _tensor_shapes(file)
            missing = sorted(expected - found.keys())
            if missing:
                raise ModelLoadError(
                    f"{file}: {INDEX_FILE} says it holds {missing[0]!r}"
                    f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, but it does not"
                )
            shapes.update(found)
        return cls(files=tuple(files), shapes=shapes)

    def iter_weights(self, shards: ShardMap | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`(hf_name, tensor)` in stored dtype; only one tensor is materialised at a time. With
        `shards` (stored name -> slice), a sharded tensor is read as that slice alone."""
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                        shard = shards(name) if shards is not None else None
                        if shard is None:
                            yield name, handle.get_tensor(name)
                        else:
                            yield name, _read_slice(handle, name, shard)
            except (SafetensorError, OSError) as error:
                raise ModelLoadError(f"{file}: cannot read tensors ({error})") from error


def _read_slice(handle: Any, name: str, shard: TensorShard) -> torch.Tensor:
    view = handle.get_slice(name)
    shape = view.get_shape()
    if shard.dim >= len(shape) or shard.stop > shape[shard.dim]:
        raise ModelLoadError(
            f"{name}: shape {list(shape)} has no [{shard.start}:{shard.stop}] along dim {shard.dim}"
        )
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
    return view[index]


def _shards_from_index(index: Path) -> dict[Path, set[str]]:
    """Each shard the index names, in first-seen order, with the tensor names it should hold."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index}: 'weight_map' is missing, empty or not an object")
    shards: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(index.parent / str(shard), set()).add(name)
    absent = [path.name for path in shards if not path.is_file()]
    if absent:
        raise ModelLoadError(
            f"{index}: lists shard(s) that do not exist: {', '.join(absent)} "
            "(an interrupted download? fetch the checkpoint again)"
        )
    return shards


def _tensor_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The names and shapes in a file's header; a truncated or corrupt file fails here, before any
    loading."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise ModelLoadError(
            f"{file}: corrupt or truncated safetensors file ({error}); download it again"
        ) from error


def _no_weights_message(folder: Path) -> str:
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = (
        f" (found {', '.join(found[:4])}: only {SINGLE_FILE} or sharded safetensors are read)"
        if found
        else ""
    )
    return f"{folder}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}"
