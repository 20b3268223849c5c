"""CUDA graphs for decode-only steps: one captured forward pass per bucketed batch size.

A decode step launches a few hundred small kernels; at small batches the GPU waits on the CPU to
launch them. A CUDA graph replays the whole forward pass with one launch. A graph fixes its
tensor addresses and shapes, so the model reads static buffers (`DecodeInputBuffers`), the real
batch is padded up to the smallest captured size, and the padding rows follow a contract the
kernels honour (see `pad_decode_batch`): they write nothing to the KV cache and their outputs are
discarded. Prompt chunks and mixed steps run eagerly; the sampler always runs outside the graph.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from kvasir.kernels import AttentionWorkspace
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.models.base import CausalLM

logger = logging.getLogger(__name__)

# Beyond this many requests a decode step is long enough that launch overhead hardly matters,
# and every extra graph costs capture time and memory (vLLM stops at the same size).
MAX_GRAPH_BATCH_SIZE = 512
# Eager runs before each capture: they compile the Triton kernels and let cuBLAS pick (and
# allocate workspace for) its kernels, none of which may happen inside a capture.
_WARMUP_RUNS = 2


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then every multiple of 8, up to `max_batch_size`.

    `max_batch_size` (capped at MAX_GRAPH_BATCH_SIZE) is always the last size, so every decode
    batch up to it has a graph.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    largest = min(max_batch_size, MAX_GRAPH_BATCH_SIZE)
    sizes = [size for size in (1, 2, 4) if size <= largest] + list(range(8, largest + 1, 8))
    if sizes[-1] != largest:
        sizes.append(largest)
    return sizes


def padded_batch_size(num_requests: int, batch_sizes: list[int]) -> int | None:
    """The smallest of the ascending `batch_sizes` that holds `num_requests`; None if none does."""
    index = bisect.bisect_left(batch_sizes, num_requests)
    return batch_sizes[index] if index < len(batch_sizes) else None


def pad_decode_batch(
    input_ids: Tensor, positions: Tensor, attn: AttentionMetadata, batch_size: int
) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """Pad a decode-only batch (one query token per request) to `batch_size` requests.

    Padding rows: input token 0 at position 0, slot -1 (`store_kv` skips it), seq_len 1, a block
    table row of zeros (block 0 always exists, so reading its first slot is safe), and one query
    row each in `query_start_loc`. The outputs of padding rows are garbage; the real rows' are
    what the unpadded batch gives. Works on any device; the block table keeps its width, and
    `max_query_len`, `max_seq_len` and `workspace` are kept.
    """
    num_requests = attn.num_requests
    if attn.max_query_len != 1 or input_ids.shape[0] != num_requests:
        raise ValueError(
            f"attn must describe a decode-only batch (one token per request), got {input_ids.shape[0]} "
            f"tokens for {num_requests} requests with max_query_len {attn.max_query_len}"
        )
    if batch_size < num_requests:
        raise ValueError(f"batch_size ({batch_size}) is smaller than the batch ({num_requests} requests)")
    pad = batch_size - num_requests
    padded = AttentionMetadata(
        # Already 0..num_requests for a decode batch; the padding rows own one query row each.
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=input_ids.device),
        seq_lens=F.pad(attn.seq_lens, (0, pad), value=1),
        block_table=F.pad(attn.block_table, (0, 0, 0, pad), value=0),
        slot_mapping=F.pad(attn.slot_mapping, (0, pad), value=-1),
        max_query_len=1,
        max_seq_len=attn.max_seq_len,
        workspace=attn.workspace,
    )
    return F.pad(input_ids, (0, pad), value=0), F.pad(positions, (0, pad), value=0), padded


class DecodeInputBuffers:
    """The static tensors a captured decode graph reads, sized for the largest batch.

    Graph `b` reads the first `b` rows of each buffer. `load` overwrites all of them with a padded
    batch, so nothing of an earlier, larger batch leaks into a later replay. The block table has
    room for the longest sequence; only the batch's own columns cross from the host, the rest of
    its rows are zeroed on the device (at 128k tokens a full table is megabytes per step).
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)

    def view(
        self, batch_size: int, max_seq_len: int, workspace: AttentionWorkspace | None
    ) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """The model's inputs for a batch of `batch_size`: views of the buffers, shared by every call."""
        attn = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_table=self.block_table[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            workspace=workspace,
        )
        return self.input_ids[:batch_size], self.positions[:batch_size], attn

    def load(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata) -> None:
        """Copy a batch already padded by `pad_decode_batch` (on any device) into the first rows."""
        size, width = attn.block_table.shape
        if size > self.max_batch_size or width > self.max_blocks_per_seq:
            raise ValueError(
                f"a padded batch of {size} x {width} blocks does not fit buffers of "
                f"{self.max_batch_size} x {self.max_blocks_per_seq}"
            )
        self.input_ids[:size].copy_(input_ids)
        self.positions[:size].copy_(positions)
        self.slot_mapping[:size].copy_(attn.slot_mapping)
        self.seq_lens[:size].copy_(attn.seq_lens)
        self.query_start_loc[: size + 1].copy_(attn.query_start_loc)
        self.block_table[:size, :width].copy_(attn.block_table)
        self.block_table[:size, width:].zero_()


class DecodeGraphRunner:
    """Captures the model's forward pass for decode batches of each size in `graph_batch_sizes`,
    and replays the right one for a real decode batch.

    Capture happens in the constructor, after the KV cache exists (the graphs bake in its
    addresses). The graphs share one memory pool and are captured largest first, so the smaller
    ones reuse the largest one's activation memory. `max_seq_len` is fixed at capture to
    `max_model_len`: the split-K decode kernel derives its launch only from that bound and the
    batch size, and reads the true lengths from `seq_lens`, so one graph serves every context.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[Tensor, Tensor]],
        *,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        workspace: AttentionWorkspace | None,
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.workspace = workspace
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buffers = DecodeInputBuffers(self.batch_sizes[-1], self.max_blocks_per_seq, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def can_run(self, attn: AttentionMetadata) -> bool:
        """Whether the step `attn` describes is decode-only and fits a captured graph."""
        return (
            attn.max_query_len == 1
            and attn.num_requests <= self.max_batch_size
            and attn.max_seq_len <= self.max_model_len
            and attn.block_table.shape[1] <= self.max_blocks_per_seq
        )

    @torch.inference_mode()
    def run(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata) -> Tensor:
        """Replay the graph for a decode batch (tensors on the host or the device; `can_run` true).

        Returns the final hidden states of the real rows, [num_requests, hidden], a fresh tensor.
        """
        num_requests = attn.num_requests
        batch_size = padded_batch_size(num_requests, self.batch_sizes)
        if batch_size is None or not self.can_run(attn):
            raise ValueError(
                f"no captured graph for this batch ({num_requests} requests, max_query_len "
                f"{attn.max_query_len}, max_seq_len {attn.max_seq_len}); run it eagerly"
            )
        self.buffers.load(*pad_decode_batch(input_ids, positions, attn, batch_size))
        graph, hidden = self._graphs[batch_size]
        graph.replay()
        # The graphs share one pool: the next replay of any of them overwrites `hidden`.
        return hidden[:num_requests].clone()

    @torch.inference_mode()
    def _capture(self) -> None:
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.batch_sizes):
            input_ids, positions, attn = self.buffers.view(batch_size, self.max_model_len, self.workspace)
            # The buffers hold padding rows only (slot -1): neither warm-up nor capture writes KV.
            for _ in range(_WARMUP_RUNS):
                self.model(input_ids, positions, self.kv_caches, attn)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(input_ids, positions, self.kv_caches, attn)
            self._graphs[batch_size] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1fs, using %.0f MiB",
            len(self.batch_sizes),
            self.batch_sizes[0],
            self.batch_sizes[-1],
            time.perf_counter() - started,
            (free_before - free_after) / (1 << 20),
        )
