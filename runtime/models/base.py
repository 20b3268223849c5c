"""The interface every model file implements for the model runner, and loading by Hugging Face name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.layers.embedding import VocabEmbedding
from kvasir.runtime.layers.linear import Linear, MergedLinear
from kvasir.runtime.layers.quantization.weights import OnlineQuantizer, QuantizedWeight
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.parallel.group import SINGLE, TensorParallel
from kvasir.runtime.parallel.partition import TensorShard

# Buffers some checkpoints carry although they are derived from the config; we recompute them.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_MAX_NAMES_LISTED = 8


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a paged KV cache, with Hugging Face parameter names.

    Built on the current default device and dtype; `load_weights` then fills every parameter.
    With a `parallel` of size N it is this rank's share of the model (`weight_shards`).
    """

    def __init__(self, config: ModelConfig, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        # Quantized models: checkpoint name -> another weight that the same tensor also fills
        # (a tied LM head built from the embedding's packed table).
        self.tied_weights: dict[str, str] = {}

    @abstractmethod
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        attn: AttentionMetadata,
        num_layers: int | None = None,
    ) -> Tensor:
        """input_ids/positions [T] int64 -> final hidden states [T, hidden]; writes this step's K/V.

        `num_layers` runs only the first that many layers, then the final norm (the self-speculative
        draft); `kv_caches` then holds those layers' caches."""

    @abstractmethod
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Hidden states [N, hidden] (only the rows to sample) -> logits [N, vocab] in float32."""

    def weight_shards(self) -> dict[str, TensorShard]:
        """Checkpoint weight name -> the slice of it this rank holds; empty at size 1, and names
        absent from it are held whole (norms, the row-parallel layers' biases)."""
        return {}

    def load_weights(
        self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]], quantize: OnlineQuantizer | None = None
    ) -> None:
        """Copy (name, tensor) pairs into the parameters of the same name, converting dtype/device.

        In a quantized model, linear and embedding weights go to their layer's `load_part` instead
        (packed `QuantizedWeight`s, or float tensors that `quantize` turns into one at load).
        Streams: each tensor is copied as it arrives, so a sharded loader can free it right after.
        Raises ModelLoadError listing every missing, unexpected or wrong-shaped parameter.
        """
        params = self.checkpoint_tensors()
        deferred = self.deferred_weights()
        # Tied parameters (lm_head.weight shared with the embedding) appear only under one name;
        # a checkpoint that still carries the alias holds the same values, so it is skipped.
        aliases = set(dict(self.named_parameters(remove_duplicate=False))) - set(
            dict(self.named_parameters())
        )
        loaded: set[str] = set()
        unexpected: list[str] = []
        mismatched: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith(_DERIVED_SUFFIXES) or name in aliases:
                    continue
                if name in deferred:
                    for target in (name, *([self.tied_weights[name]] if name in self.tied_weights else [])):
                        layer, index = deferred[target]
                        problem = layer.load_part(index, tensor, quantize)
                        if problem is not None:
                            mismatched.append(f"{target} ({problem})")
                        else:
                            loaded.add(target)
                    continue
                if isinstance(tensor, QuantizedWeight):  # a norm or bias stored quantized: tiny
                    tensor = tensor.dequantize()
                param = params.get(name)
                if param is None:
                    unexpected.append(name)
                elif tuple(tensor.shape) != tuple(param.shape):
                    mismatched.append(f"{name} (expected {tuple(param.shape)}, got {tuple(tensor.shape)})")
                else:
                    param.copy_(tensor)
                    loaded.add(name)
        missing = [name for name in [*params, *deferred] if name not in loaded]
        problems = [
            f"{label}: {_listing(names)}"
            for label, names in (
                ("shape mismatch", mismatched),
                ("missing", missing),
                ("unexpected", unexpected),
            )
            if names
        ]
        if problems:
            raise ModelLoadError(f"weights do not fit {self.config.architecture}: " + "; ".join(problems))

    def deferred_weights(self) -> dict[str, tuple[Linear | VocabEmbedding, int]]:
        """Checkpoint weight name -> (layer, part index) for every layer of a quantized model that
        still waits for its weight (`load_part`); empty for a float model."""
        found: dict[str, tuple[Linear | VocabEmbedding, int]] = {}
        for path, module in self.named_modules():
            if isinstance(module, Linear | VocabEmbedding) and module.deferred:
                for name, index in module.checkpoint_parts(path).items():
                    found[name] = (module, index)
        return found

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        """Every name a checkpoint provides -> the tensor it fills: a parameter, or the rows of a
        `MergedLinear`'s stacked parameter (so `q_proj.weight` lands in `qkv_proj.weight`)."""
        targets: dict[str, Tensor] = dict(self.named_parameters())
        for path, module in self.named_modules():
            if isinstance(module, MergedLinear):
                for leaf in ("weight", "bias"):
                    targets.pop(f"{path}.{leaf}", None)
                parent = path.rpartition(".")[0]
                for name, view in module.checkpoint_views().items():
                    targets[f"{parent}.{name}" if parent else name] = view
        return targets


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_LISTED])
    more = len(names) - _MAX_NAMES_LISTED
    return f"{shown} and {more} more" if more > 0 else shown
