"""Drive a model step by step over a paged KV cache, as the model runner does, without an engine."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.models.base import CausalLM

BLOCK_SIZE = 4  # small, so prompts span many blocks and chunks of 3 start mid-block


class PagedRunner:
    """Drives a model step by step as the model runner does, with blocks handed out by the test."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, seed: int = 0) -> None:
        config = model.config
        self.model = model
        shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        # Garbage, not zeros: attention must never read a slot it did not write.
        self.kv_caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_hidden_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order block tables
        self.blocks: dict[int, list[int]] = {}

    def step(
        self,
        chunks: list[tuple[int, list[int], int]],
        attach: Callable[[AttentionMetadata], AttentionMetadata] | None = None,
    ) -> list[torch.Tensor]:
        """Each chunk is (request id, token ids, position of the first); returns logits per chunk.
        `attach` may add to the step's metadata (e.g. its LoRA rows) before the model runs."""
        positions, slots, seq_lens = [], [], []
        for rid, tokens, start in chunks:
            blocks = self.blocks.setdefault(rid, [])
            end = start + len(tokens)
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            pos = torch.arange(start, end)
            positions.append(pos)
            slots.append(torch.tensor(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq_lens.append(end)
        max_blocks = max(len(self.blocks[rid]) for rid, _, _ in chunks)
        table = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for row, (rid, _, _) in enumerate(chunks):
            table[row, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid], dtype=torch.int32)
        query_lens = [len(tokens) for _, tokens, _ in chunks]
        starts = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(query_lens).cumsum(0)
        attn = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=torch.cat(slots),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        if attach is not None:
            attn = attach(attn)
        input_ids = torch.tensor([t for _, tokens, _ in chunks for t in tokens])
        with torch.inference_mode():
            hidden = self.model(input_ids, torch.cat(positions), self.kv_caches, attn)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))
