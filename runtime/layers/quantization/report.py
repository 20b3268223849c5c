"""What a loaded model holds: which kernel runs each layer and how many bytes the weights take."""

from __future__ import annotations

from collections import Counter

from torch import nn

from kvasir.runtime.layers.embedding import VocabEmbedding
from kvasir.runtime.layers.linear import Linear
from kvasir.runtime.outputs import WeightsReport


def weights_report(model: nn.Module, quantization: str | None) -> WeightsReport:
    """Count kernels over the model's linear and embedding layers, and the bytes of every distinct
    parameter and buffer storage (tied weights and views count once)."""
    kernels: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Linear | VocabEmbedding):
            kernels.update(module.describe())
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return WeightsReport(
        quantization=quantization, kernels=dict(kernels), weight_bytes=sum(storages.values())
    )
