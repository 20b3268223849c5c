"""Compile the GPU kernels a server needs before its first request does.

On a GPU each Triton kernel variant compiles on first use, which takes seconds: without a warm-up
the first long prompt after start-up would wait for the prefill kernel's compile. The runner runs
the model once over dummy batches that take each attention path (a short chunk, a long prompt, a
decode). The dummy rows follow the padding contract of `kvasir.runtime.worker.cuda_graphs`: slot -1, so
nothing is written to the KV cache, and block 0 for reads, whose garbage outputs are discarded.
"""

from __future__ import annotations

import logging
import time

import torch

from kvasir.kernels import AttentionWorkspace
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.models.base import CausalLM

logger = logging.getLogger(__name__)

# Query lengths of the dummy prefills: below and above the unified kernel's long-prompt threshold.
_PREFILL_LENGTHS = (16, 256)


def dummy_batch(
    query_len: int, block_size: int, device: torch.device, workspace: AttentionWorkspace | None = None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One request whose `query_len` tokens are its whole context, stored nowhere (slot -1)."""
    num_blocks = -(-query_len // block_size)
    attn = AttentionMetadata(
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([query_len], dtype=torch.int32, device=device),
        block_table=torch.zeros(1, num_blocks, dtype=torch.int32, device=device),
        slot_mapping=torch.full((query_len,), -1, dtype=torch.int64, device=device),
        max_query_len=query_len,
        max_seq_len=query_len,
        workspace=workspace,
    )
    input_ids = torch.zeros(query_len, dtype=torch.int64, device=device)
    positions = torch.arange(query_len, dtype=torch.int64, device=device)
    return input_ids, positions, attn


@torch.inference_mode()
def warm_up_kernels(
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    block_size: int,
    max_tokens: int,
    device: torch.device,
    workspace: AttentionWorkspace | None,
) -> None:
    """Run the model over a decode and prefills of up to `max_tokens` tokens; log how long it took."""
    started = time.perf_counter()
    lengths = sorted({1, *(min(length, max_tokens) for length in _PREFILL_LENGTHS)})
    for length in lengths:
        input_ids, positions, attn = dummy_batch(length, block_size, device, workspace)
        model(input_ids, positions, kv_caches, attn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("kernels warmed up (query lengths %s) in %.1fs", lengths, time.perf_counter() - started)
