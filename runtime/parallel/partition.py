"""Which part of each sharded dimension a rank holds: attention heads, KV heads, the vocabulary.

Pure arithmetic over a `TensorParallel` and the model's counts, shared by the layers (how big a
rank's share is) and the loader (which slice of a stored tensor to read). `TensorShard` is the
hand-off between them: the model names, per checkpoint weight, the slice this rank keeps; the
loader reads only that slice from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvasir.runtime.parallel.group import TensorParallel


@dataclass(frozen=True)
class TensorShard:
    """Rows (`dim` 0) or columns (`dim` 1) [start, stop) of a weight's logical [out, in] shape
    (a vector's elements for `dim` 0) that this rank keeps."""

    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


# Checkpoint (Hugging Face) weight name -> this rank's slice of it; None: the whole tensor.
ShardMap = Callable[[str], TensorShard | None]


@dataclass(frozen=True)
class HeadShard:
    """This rank's attention heads: q heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(parallel: TensorParallel, num_heads: int, num_kv_heads: int) -> HeadShard:
    """This rank's query and KV heads.

    With at least N KV heads, each rank takes whole KV heads with the query heads that read them
    (a GQA group stays on one rank): KV heads [floor(r K / N), floor((r + 1) K / N)). When N divides
    K that is an even split, as vLLM's; when it does not, the ranks' shares differ by one KV head
    and its group, where vLLM refuses; the larger shares go to the last ranks, as rank 0 also
    schedules and samples. The embedded SmolLM2-135M (9 heads, 3 KV heads) thus runs at 2 ranks:
    3 heads and 1 KV head on rank 0, 6 and 2 on rank 1. Attention is then unbalanced (its share of
    a step, not the MLP's, which splits evenly); the row-parallel all-reduce does not care.

    Fewer KV heads than ranks are replicated (as vLLM does): each rank holds the one KV head its
    query heads read, and the ranks sharing it compute it redundantly; N must then be a multiple of
    K and divide the query heads. ValueError naming the flag otherwise."""
    if num_kv_heads >= parallel.size:
        group = num_heads // num_kv_heads  # query heads per KV head (the config checks it divides)
        kv_start = parallel.rank * num_kv_heads // parallel.size
        kv_stop = (parallel.rank + 1) * num_kv_heads // parallel.size
        return HeadShard(kv_start * group, (kv_stop - kv_start) * group, kv_start, kv_stop - kv_start)
    if parallel.size % num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {parallel.size} must be a multiple of the number of key/value "
            f"heads ({num_kv_heads}) when it exceeds it (each KV head is then replicated on "
            f"{parallel.size}/{num_kv_heads} ranks)"
        )
    q_start, q_stop = parallel.shard(num_heads, "the number of attention heads")
    return HeadShard(q_start, q_stop - q_start, parallel.rank * num_kv_heads // parallel.size, 1)


def vocab_shard(parallel: TensorParallel, vocab_size: int) -> tuple[int, int, int]:
    """(start, stop, padded) for this rank's rows of the embedding and the LM head: each rank
    holds ceil(vocab/N) rows, the last ones fewer when N does not divide the vocabulary; `padded`
    (ceil(vocab/N)) is the width every rank's logits are padded to before they are gathered."""
    padded = -(-vocab_size // parallel.size)
    start = min(parallel.rank * padded, vocab_size)
    return start, min(start + padded, vocab_size), padded
