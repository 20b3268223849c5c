"""Paged attention for one layer, and the per-step metadata the model runner builds for it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kvasir.kernels import AttentionWorkspace, paged_attention, rotary_store_kv, store_kv
from kvasir.kernels.attention import cpu_attention_step
from kvasir.kernels.cpu_ops.paged_attention_step import PagedAttentionStep
from kvasir.runtime.layers.lora import LoRAStep


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache; built once per step, shared by all layers.

    Requests are flattened: request r owns query rows `query_start_loc[r]:query_start_loc[r+1]`.
    `max_query_len` and `max_seq_len` are host-side bounds of the lengths (the Triton kernels size
    their launch from them without reading the tensors, which keeps a step free of device syncs
    and capturable in a CUDA graph); they may exceed the true maxima, never fall short of them.
    """

    query_start_loc: Tensor  # [R+1] int32
    seq_lens: Tensor  # [R] int32, context length after this step
    block_table: Tensor  # [R, max_blocks] int32 (padded with 0)
    slot_mapping: Tensor  # [T] int64; -1 for a token that must not be stored
    max_query_len: int
    max_seq_len: int
    # Split-K scratch buffers for the Triton decode kernel, allocated once by the model runner;
    # None lets the kernel allocate its own (the torch reference ignores it).
    workspace: AttentionWorkspace | None = None
    # The step's LoRA adapter rows; None when no row of the step has an adapter, and then the
    # layers run exactly their base code (the CPU decoder stack and CUDA graphs included).
    lora: LoRAStep | None = None
    # The CPU kernels bound to this step, by the first layer that asks (`cpu_step`), keyed by the
    # query and cache shapes (a draft model may share the metadata); not copied by `to`/`replace`.
    _cpu_steps: dict[tuple[object, ...], PagedAttentionStep | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def cpu_step(self, q: Tensor, k_cache: Tensor) -> PagedAttentionStep | None:
        """The step's C attention kernels for layers of q's and k_cache's shapes, checked and bound
        once for all of them; None where those kernels do not run this step."""
        key = (q.shape, q.dtype, q.device, k_cache.shape, k_cache.dtype)
        if key not in self._cpu_steps:
            self._cpu_steps[key] = cpu_attention_step(
                q,
                k_cache,
                self.block_table,
                self.seq_lens,
                self.query_start_loc,
                self.slot_mapping,
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
            )
        return self._cpu_steps[key]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device, workspace: AttentionWorkspace | None = None) -> AttentionMetadata:
        """The same metadata with its tensors on `device` and `workspace` attached."""
        return dataclasses.replace(
            self,
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_table=self.block_table.to(device),
            slot_mapping=self.slot_mapping.to(device),
            workspace=workspace,
        )


class Attention(nn.Module):
    """Stores this step's K/V in the layer's cache, then attends causally over each request's context.

    Projections belong to the model file, and so does the rotary table: the model passes this
    step's angles and the rotation is done here, fused with the store where a kernel can do both
    in one pass (on CPU). This module has no parameters.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Per-tensor scales of an fp8 KV cache (stored = value / scale). 1.0, as in vLLM when a
        # checkpoint carries no calibrated scales: e4m3 spans +-448, well beyond typical K/V values.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        attn: AttentionMetadata,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> attention output [T, Hq * D]. With `rotary` (cos, sin
        [T, 1, D/2]), q and k are rotated by it first."""
        k_cache, v_cache = kv_cache
        step = (
            attn.cpu_step(q, k_cache) if rotary is not None and self.k_scale == self.v_scale == 1.0 else None
        )
        if step is not None and rotary is not None:  # the CPU decode path: no per-layer re-checks
            q = step.rotary_store_kv(q, k, v, *rotary, k_cache, v_cache)
            out = step.attend(q, k_cache, v_cache, self.scale, self.sliding_window)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        if rotary is not None:
            cos, sin = rotary
            q = rotary_store_kv(
                q,
                k,
                v,
                cos,
                sin,
                k_cache,
                v_cache,
                attn.slot_mapping,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        else:
            store_kv(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            attn.block_table,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            self.sliding_window,
            max_query_len=attn.max_query_len,
            max_seq_len=attn.max_seq_len,
            workspace=attn.workspace,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}"
