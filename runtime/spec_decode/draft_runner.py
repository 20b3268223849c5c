"""The model-based drafters of speculative decoding: a smaller draft model, or the target's own
first layers (self-speculation by layer skipping).

Both propose greedily: a drafter that is a point mass keeps rejection sampling exact for sampled
requests, and it needs no draft probabilities. Both write KV at the same slots as the target
(the draft shares the target's block tables), so the scheduler's block accounting covers them:
it holds `num_speculative_tokens` lookahead slots past each request's scheduled tokens, which is
where the drafter writes the KV of what it proposes. Every such slot lies at or after the
request's newest token, so the target's next verification step overwrites it before anything
reads it as context, and none of it is ever offered to the prefix cache.

- **draft_model**: its own KV tensors (same block ids, its own heads and layers). It runs over
  every step's batch after the target (`mirror`), so its KV is always in step with the target's,
  prefix-cache hits included (the request that computed a cached block also ran the draft over it).
- **layer_skip**: the target's first L layers, final norm and LM head. Those layers' KV is the
  target's own: layer l's KV at a position depends only on the tokens up to it, so the target's
  verification step already computes exactly what the draft needs. No second model, no extra KV.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvasir.kernels import AttentionWorkspace
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class DraftRunner:
    """Proposes draft tokens for requests whose newest token is known, one batched pass per token."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target: CausalLM,
        draft: CausalLM | None,
        *,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        if config.method not in ("draft_model", "layer_skip"):
            raise ValueError(f"DraftRunner serves draft_model and layer_skip, not {config.method!r}")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.target = target
        target_config = target.config
        if config.method == "draft_model":
            if draft is None:
                raise ValueError("method 'draft_model' needs a loaded draft model")
            if draft.config.vocab_size != target_config.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                    f"target's ({target_config.vocab_size}); a draft model must share the tokenizer"
                )
            self.model: CausalLM = draft
            self.num_layers: int | None = None
        else:
            num_layers = config.num_layers or 0
            if not 1 <= num_layers < target_config.num_hidden_layers:
                raise ValueError(
                    f"speculative_config.num_layers must be between 1 and {target_config.num_hidden_layers - 1} "
                    f"(the target has {target_config.num_hidden_layers} layers), got {num_layers}"
                )
            self.model = target
            self.num_layers = num_layers
        self.kv_caches: KVCaches = []

    @property
    def kv_elements_per_token(self) -> int:
        """KV elements per token the drafter needs beyond the target's (none for layer skip)."""
        if self.num_layers is not None:
            return 0
        shape = self.model.config
        return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim

    def bind_kv_caches(self, target_kv_caches: KVCaches, num_blocks: int, dtype: torch.dtype) -> None:
        """Layer skip reads and writes the target's first layers; a draft model gets its own tensors."""
        if self.num_layers is not None:
            self.kv_caches = target_kv_caches[: self.num_layers]
            return
        shape = self.model.config
        cache_shape = (num_blocks, self.block_size, shape.num_key_value_heads, shape.head_dim)
        self.kv_caches = [
            (
                torch.zeros(cache_shape, dtype=dtype, device=self.device),
                torch.zeros(cache_shape, dtype=dtype, device=self.device),
            )
            for _ in range(shape.num_hidden_layers)
        ]

    @property
    def needs_mirror(self) -> bool:
        """A draft model must run over every step of the target; layer skip shares its KV."""
        return self.num_layers is None

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """Run the draft model over the target's step, so its KV stays in step with the target's."""
        self.model(input_ids, positions, self.kv_caches, attn)

    def propose(
        self,
        last_token_ids: Sequence[int],
        num_tokens: Sequence[int],
        block_tables: Sequence[list[int]],
        workspace: AttentionWorkspace | None,
    ) -> list[list[int]]:
        """Greedy drafts: request r continues from its newest token `last_token_ids[r]` (position
        `num_tokens[r] - 1`) for as many tokens as `self.config.num_speculative_tokens`."""
        num_requests = len(last_token_ids)
        if num_requests == 0:
            return []
        k = self.config.num_speculative_tokens
        width = max(len(table) for table in block_tables)
        table = np.zeros((num_requests, width), dtype=np.int32)
        for row, block_ids in enumerate(block_tables):
            table[row, : len(block_ids)] = block_ids
        block_table = torch.from_numpy(table).to(self.device)
        query_start_loc = torch.arange(num_requests + 1, dtype=torch.int32, device=self.device)
        positions = torch.tensor(num_tokens, dtype=torch.int64, device=self.device) - 1
        tokens = torch.tensor(last_token_ids, dtype=torch.int64, device=self.device)
        rows = torch.arange(num_requests, device=self.device)
        drafts = []
        max_seq_len = max(num_tokens)
        for step in range(k):
            slot_mapping = block_table[rows, positions // self.block_size].to(
                torch.int64
            ) * self.block_size + (positions % self.block_size)
            attn = AttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=(positions + 1).to(torch.int32),
                block_table=block_table,
                slot_mapping=slot_mapping,
                max_query_len=1,
                max_seq_len=max_seq_len + step,
                workspace=workspace,
            )
            hidden = self.model(tokens, positions, self.kv_caches, attn, self.num_layers)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(tokens)
            # Past the context length nothing will be verified; stay on the last position (a
            # speculative slot of the request) so the rotary tables are never indexed past their end.
            positions = (positions + 1).clamp(max=self.max_model_len - 1)
        return torch.stack(drafts, dim=1).tolist()
