"""The device tier of LoRA adapters: a fixed pool of `max_loras` slots, each sized for
`max_lora_rank` on every target projection, allocated once at start-up (and counted against the
KV cache's memory, `kv_budget.lora_pool_bytes`).

Per step, on the thread that runs the step (the engine thread, or the step-executor thread with
async scheduling: steps run there in order, so a slot is never rewritten while an earlier step
that reads it is still queued), `bind_step` gives each of the step's adapters a slot: one already
holding it, else a free one, else the least recently used slot this step does not use, copied in
from the host tier (`LoRAHostCache`). An adapter of rank r < max_lora_rank fills the first r rows
of A and of B's transposed block and leaves zeros after them, which add exact zeros.

Under tensor parallelism the pool holds this rank's share of every adapter, cut as the base
weights are: B's rows of its outputs for q/k/v and gate/up, A's columns of its inputs for o and
down (`weight_shards`; the host tier keeps adapters whole).

The pool holds `--lora-dtype` (`pool_dtype`: "auto" is the model's dtype, float32 on the CPU). The
host tier keeps each adapter in that same dtype: a bfloat16 pool halves host memory too, and
rounding once at load gives the very values a copy into the pool would (the copy is then exact).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kvasir.kernels.cpu_ops.decoder_stack_lora import LoRAPool
from kvasir.kernels.lora_rows import LoRARows
from kvasir.runtime.config import EngineConfig, ModelConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.layers.attention import AttentionMetadata
from kvasir.runtime.layers.lora import LoRALayerWeights, LoRAProjection, LoRAStep
from kvasir.runtime.loader.lora_adapter import LoRAAdapter, load_lora_adapter, module_shapes
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.parallel.partition import TensorShard
from kvasir.runtime.worker.kv_budget import lora_pool_bytes
from kvasir.runtime.worker.lora_host import LoRAHostCache

# On the CPU, steps of at most this many rows with several adapters run the dense layout.
DENSE_MAX_ROWS = 64
# Each pooled projection: its attribute on LoRALayerWeights and the checkpoint modules it merges.
_PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class StepAdapters:
    """A step's adapters, from the plan (host side): the distinct adapters, and each batch row's
    index into them (-1: no adapter)."""

    adapters: tuple[LoRARequest, ...]
    row_adapter: np.ndarray  # [T] int64

    @classmethod
    def from_plan(cls, plan: SchedulerOutput) -> StepAdapters | None:
        """None when no scheduled request has an adapter (the step then runs the base code)."""
        loras = [item.request.lora for item in plan.scheduled]
        if all(lora is None for lora in loras):
            return None
        index: dict[int, int] = {}
        adapters: list[LoRARequest] = []
        per_request = np.empty(len(loras), dtype=np.int64)
        for r, lora in enumerate(loras):
            if lora is None:
                per_request[r] = -1
                continue
            if lora.adapter_id not in index:
                index[lora.adapter_id] = len(adapters)
                adapters.append(lora)
            per_request[r] = index[lora.adapter_id]
        counts = np.fromiter((item.num_tokens for item in plan.scheduled), dtype=np.int64, count=len(loras))
        return cls(tuple(adapters), np.repeat(per_request, counts))


def pool_dtype(lora_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The slot pool's dtype for `--lora-dtype`: "auto" is the model's dtype (as vLLM's)."""
    return model_dtype if lora_dtype == "auto" else getattr(torch, lora_dtype)


# Pool dtypes the C decoder stack reads (its `lora_add`); a float16 pool on the CPU runs layer by layer.
_STACK_DTYPES = (torch.float32, torch.bfloat16)


class LoRASlots:
    """The slot pool, its host tier, and the binding of a step's adapters to slots."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        model_dtype: torch.dtype,
        weight_shards: Mapping[str, TensorShard] | None = None,
    ) -> None:
        """`weight_shards`: the model's (`CausalLM.weight_shards`), under tensor parallelism."""
        self.num_slots, self.max_rank = config.max_loras, config.max_lora_rank
        dtype = pool_dtype(config.lora_dtype, model_dtype)
        self.device, self.dtype = device, dtype
        self.model_config = model_config
        self.host = LoRAHostCache(config.cpu_lora_capacity, self._read)
        # Target module -> this rank's slice of its [out, in] weight (the same in every layer).
        self._shards = _module_shards(weight_shards or {})
        shapes = {
            module: self._rank_shape(module, shape) for module, shape in module_shapes(model_config).items()
        }
        sizes_of = [
            (len(modules), shapes[modules[0]][0], sum(shapes[m][1] for m in modules))
            for modules in _PROJECTIONS.values()
        ]
        self.nbytes = lora_pool_bytes(
            sizes_of, model_config.num_hidden_layers, self.num_slots, self.max_rank, dtype.itemsize
        )
        slots, rank = self.num_slots, self.max_rank
        layers = []
        for _ in range(model_config.num_hidden_layers):
            projections: dict[str, LoRAProjection] = {}
            for field, modules in _PROJECTIONS.items():
                n_in = shapes[modules[0]][0]
                sizes = tuple(shapes[m][1] for m in modules)
                projections[field] = LoRAProjection(
                    a=torch.zeros(slots, len(modules) * rank, n_in, dtype=dtype, device=device),
                    b=torch.zeros(slots, len(modules) * rank, sum(sizes), dtype=dtype, device=device),
                    slice_sizes=sizes,
                )
            layers.append(LoRALayerWeights(**projections))
        self.layers = tuple(layers)
        self.scalings = torch.zeros(slots, dtype=torch.float32, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.int32, device=device)  # each slot's adapter's rank
        # The C decoder stack reads these very tensors (on the CPU, float32 or bfloat16; it computes
        # in float32 and so runs only with the model's float32 activations, see llama.py).
        self.stack_pool = (
            LoRAPool(
                tuple(
                    {field: (getattr(layer, field).a, getattr(layer, field).b) for field in _PROJECTIONS}
                    for layer in self.layers
                ),
                rank,
                self.scalings,
                self.ranks,
                dtype,
            )
            if device.type == "cpu" and dtype in _STACK_DTYPES
            else None
        )
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._removed: set[int] = set()
        self._removed_lock = threading.Lock()
        self.copies_total = 0  # host -> slot copies

    # -- any thread -------------------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> None:
        """Read and check the adapter's files into the host tier (in this thread); LoRAAdapterError."""
        self.host.add(lora)

    def remove(self, adapter_id: int) -> None:
        """Forget the adapter; its slot is freed at the next step (slots belong to the step thread)."""
        self.host.remove(adapter_id)
        with self._removed_lock:
            self._removed.add(adapter_id)

    def prefetch(self, loras: Iterable[LoRARequest]) -> None:
        """Read in the background any of `loras` not in host memory (e.g. waiting requests')."""
        self.host.prefetch(loras)

    # -- the step's thread ------------------------------------------------------------------------
    def resident(self) -> dict[int, int]:
        """Adapter id -> slot, for the adapters now in slots."""
        return dict(self._slot_of)

    def bind_step(self, adapters: StepAdapters, attn: AttentionMetadata) -> AttentionMetadata:
        """`attn` with the step's LoRA rows attached, every adapter of the step put in a slot."""
        slots = self.assign(adapters.adapters)
        table = np.asarray(slots, dtype=np.int64)
        token_slots = np.where(adapters.row_adapter >= 0, table[np.maximum(adapters.row_adapter, 0)], -1)
        rows = LoRARows.build(
            token_slots, self.device, self._dense_slots(len(token_slots), len(adapters.adapters))
        )
        return dataclasses.replace(attn, lora=LoRAStep(rows, self.scalings, self.layers, self.stack_pool))

    def _dense_slots(self, num_rows: int, num_adapters: int) -> int | None:
        """The pool's size when the CPU path should run this step dense: a small batch with more
        than one adapter (see `kvasir.kernels.lora_grouped`); None otherwise."""
        dense = self.device.type == "cpu" and num_adapters > 1 and num_rows <= DENSE_MAX_ROWS
        return self.num_slots if dense else None

    def assign(self, adapters: tuple[LoRARequest, ...]) -> list[int]:
        """A slot for each adapter (in order), copying in those not resident; RuntimeError when the
        step has more distinct adapters than slots (the scheduler keeps it to --max-loras)."""
        if len(adapters) > self.num_slots:
            raise RuntimeError(
                f"a step has {len(adapters)} distinct LoRA adapters but there are {self.num_slots} "
                "slots (--max-loras); the scheduler must keep a step within them"
            )
        self._free_removed()
        wanted = {lora.adapter_id for lora in adapters}
        slots = []
        for lora in adapters:
            slot = self._slot_of.get(lora.adapter_id)
            if slot is None:
                slot = self._free_slot(wanted)
                self._copy_in(slot, self.host.get(lora))
                self._slot_of[lora.adapter_id] = slot
            self._slot_of.move_to_end(lora.adapter_id)
            slots.append(slot)
        return slots

    def _free_removed(self) -> None:
        with self._removed_lock:
            removed, self._removed = self._removed, set()
        for adapter_id in removed:
            self._slot_of.pop(adapter_id, None)

    def _free_slot(self, wanted: set[int]) -> int:
        """A slot holding nothing, else the least recently used one holding no adapter of this step."""
        used = set(self._slot_of.values())
        for slot in range(self.num_slots):
            if slot not in used:
                return slot
        for adapter_id, slot in self._slot_of.items():  # least recently used first
            if adapter_id not in wanted:
                del self._slot_of[adapter_id]
                return slot
        raise AssertionError("assign checked that the step fits the slots")

    def _copy_in(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write the adapter into `slot` of every layer: A rows and B columns up to its rank, zeros
        after them, and zeros for the modules it does not target."""
        rank = adapter.rank
        with torch.inference_mode():
            for layer, weights in enumerate(self.layers):
                for field, modules in _PROJECTIONS.items():
                    projection: LoRAProjection = getattr(weights, field)
                    a, b = projection.a[slot], projection.b[slot]
                    a.zero_()
                    b.zero_()
                    offset = 0
                    for index, (module, size) in enumerate(zip(modules, projection.slice_sizes, strict=True)):
                        pair = adapter.weights.get((layer, module))
                        if pair is not None:
                            first = index * self.max_rank
                            down, up = self._rank_pair(module, pair)
                            a[first : first + rank].copy_(down)
                            b[first : first + rank, offset : offset + size].copy_(up.t())
                        offset += size
            self.scalings[slot] = adapter.scaling
            self.ranks[slot] = rank
        self.copies_total += 1

    def _rank_shape(self, module: str, shape: tuple[int, int]) -> tuple[int, int]:
        """(in, out) of `module`'s share on this rank."""
        shard = self._shards.get(module)
        if shard is None:
            return shape
        return (shape[0], shard.size) if shard.dim == 0 else (shard.size, shape[1])

    def _rank_pair(
        self, module: str, pair: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A [r, in] and B [out, r] cut to this rank's share: B's rows of its outputs
        (column-parallel), or A's columns of its inputs (row-parallel)."""
        a, b = pair
        shard = self._shards.get(module)
        if shard is None:
            return a, b
        if shard.dim == 0:
            return a, b[shard.start : shard.stop]
        return a[:, shard.start : shard.stop], b

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        return load_lora_adapter(lora.path, self.model_config, self.max_rank, self.dtype)

    def close(self) -> None:
        self.host.close()


def _module_shards(weight_shards: Mapping[str, TensorShard]) -> dict[str, TensorShard]:
    """Target module name (`q_proj`) -> its slice, from layer 0's checkpoint names."""
    found = {}
    for modules in _PROJECTIONS.values():
        for module in modules:
            for prefix in ("self_attn", "mlp"):
                shard = weight_shards.get(f"model.layers.0.{prefix}.{module}.weight")
                if shard is not None:
                    found[module] = shard
    return found
