"""The token embedding: nn.Embedding whose table, in a quantized model, may stay in the file's format.

As with `Linear`, a quantized model builds it on a "meta" placeholder; `load_part` then takes the
table as a plain tensor (it becomes the parameter) or as a `QuantizedWeight`, whose
`build_embedding` gives a row lookup (GGUF gathers the rows' blocks and dequantizes only those).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvasir.runtime.layers.quantization.weights import EmbeddingKernel, QuantizedWeight


class VocabEmbedding(nn.Embedding):
    """`model.embed_tokens`: ids [T] -> rows [T, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, quantized: bool = False) -> None:
        self.target_device = torch.empty(0).device
        self.target_dtype = torch.get_default_dtype()
        if quantized:
            # A ready placeholder, not nn.Embedding's own: its random init on "meta" would import
            # torch._dynamo (with sympy and triton, ~150 MiB resident) for a table never used.
            placeholder = torch.empty(num_embeddings, embedding_dim, device="meta")
            super().__init__(num_embeddings, embedding_dim, _weight=placeholder)
        else:
            super().__init__(num_embeddings, embedding_dim)
        self.kernel: EmbeddingKernel | None = None
        self.deferred = quantized

    def load_part(self, index: int, weight: Tensor | QuantizedWeight, quantize: object = None) -> str | None:
        """Take the table (index 0); a problem string for a wrong shape, else None. (`quantize`,
        the online quantizer linear layers take, does not apply: embeddings stay as stored.)"""
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(weight.shape) != expected:
            return f"expected {expected}, got {tuple(weight.shape)}"
        if isinstance(weight, Tensor):
            self.weight = nn.Parameter(weight.to(self.target_device, self.target_dtype), requires_grad=False)
        else:
            self.kernel = weight.build_embedding(self.target_device, self.target_dtype)
            del self.weight
            self.register_parameter("weight", None)
        self.deferred = False
        return None

    def checkpoint_parts(self, path: str) -> dict[str, int]:
        return {f"{path}.weight": 0}

    def forward(self, ids: Tensor) -> Tensor:
        if self.kernel is not None:
            return self.kernel(ids)
        return super().forward(ids)

    def describe(self) -> list[str]:
        if self.kernel is not None:
            return [self.kernel.describe()]
        return [f"dense {str(self.weight.dtype).removeprefix('torch.')}"]
