"""The layers that talk to the other ranks under tensor parallelism (`--tensor-parallel-size N`).

Column-parallel projections (q/k/v, gate/up) need no layer of their own: each rank's `Linear` or
`MergedLinear` is built with its share of the output rows and the loader reads those rows only.
What needs communication is here:

- `RowParallelLinear` (o_proj, down_proj): each rank holds a slice of the input columns, matching
  the column-parallel outputs that feed it, so its product is a partial sum: one all-reduce
  completes it, and the bias (held whole by every rank) is added once, after the sum. Where the
  layer is the CPU's packed GEMM the partial is float64, summed over the weight's groups in float64
  (`TiledGemm.run_wide`), all-reduced in float64 and rounded to float32 once: the result is then
  the bits of one process's (all but ties at 2^-29), whatever the number of ranks. In float32 the
  ranks' partials would end in other last bits than one process's running sum, and 30 layers
  amplify those to about 1e-4 in the logits. Models build o_proj and down_proj as this layer at
  every size (at size 1 the all-reduce is a no-op), so size 1 sums the same way.
- `VocabParallelEmbedding`: each rank holds a contiguous range of the vocabulary's rows; ids
  outside it look up nothing (zeros), and an all-reduce assembles every row.
- `gather_logits`: each rank's LM head computes its vocabulary slice; the slices are padded to one
  width (the last rank's is short when N does not divide the vocabulary), gathered in rank order,
  and the padding cut, so every rank holds the full logits.

At size 1 the models build a plain `VocabEmbedding` and LM head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvasir.runtime.layers.embedding import VocabEmbedding
from kvasir.runtime.layers.linear import Linear
from kvasir.runtime.parallel.group import TensorParallel


class RowParallelLinear(Linear):
    """`Linear` over this rank's `in_features` columns; `forward` returns the full sum on every rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: TensorParallel,
        bias: bool = False,
        *,
        quantized: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, quantized=quantized)
        self.parallel = parallel

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: Tensor) -> Tensor:
        """This rank's share of the product, a fresh tensor (float64 from the CPU's packed GEMM, see
        the module docstring), without the bias (added once, after the sum). A LoRA term of this
        rank's input columns is added into it before `reduce`."""
        return self.wide_product(x)

    def reduce(self, partial: Tensor) -> Tensor:
        """The ranks' partial products summed (in place) and rounded to the model's dtype once,
        plus the bias."""
        total = self.parallel.all_reduce(partial)
        if total.dtype == torch.float64 and self.target_dtype != torch.float64:
            total = total.to(self.target_dtype)
        return total if self.bias is None else total + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """`model.embed_tokens` holding vocabulary rows [start, stop); ids [T] -> full rows [T, hidden]."""

    def __init__(
        self,
        start: int,
        stop: int,
        embedding_dim: int,
        parallel: TensorParallel,
        *,
        quantized: bool = False,
    ) -> None:
        super().__init__(stop - start, embedding_dim, quantized=quantized)
        self.start = start
        self.parallel = parallel

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = super().forward(local.masked_fill(outside, 0))
        # A fresh tensor (the all-reduce writes into it): zeros where another rank holds the row.
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(rows)


def gather_logits(local: Tensor, parallel: TensorParallel, padded: int, vocab_size: int) -> Tensor:
    """This rank's logits [T, stop - start] -> every rank's, [T, vocab_size], identical on all ranks."""
    if local.shape[-1] < padded:
        local = nn.functional.pad(local, (0, padded - local.shape[-1]))
    return parallel.all_gather(local, dim=-1)[..., :vocab_size]
