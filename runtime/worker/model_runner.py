"""The model runner: owns the weights and the paged KV cache tensors, and runs one step.

All tensor work of a step happens here: the scheduler's plan becomes a flattened batch
(`input_ids`, `positions`, attention metadata), the model runs once over it, and the sampler picks
one token for every request whose prompt is now fully computed. On CUDA with the Triton kernels,
decode-only steps replay captured CUDA graphs (`kvasir.runtime.worker.cuda_graphs`) instead.

Under tensor parallelism every rank builds a runner over its share of the model and KV heads
(docs/tensor-parallel.md) and is called with the same arguments in the same order. All ranks run
the forward pass and the LM head (whose logits every rank ends up holding in full); the driver
(rank 0) alone applies grammar masks and samples, and its sampled tokens are broadcast, so every
rank's `StepOutcome.token_tensor` is the same.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvasir.kernels import AttentionWorkspace
from kvasir.kernels.cpu_ops import enabled as cpu_kernels_enabled
from kvasir.kernels.cpu_ops import paged_attention as cpu_attention
from kvasir.kernels.dispatch import choose_backend, use_triton
from kvasir.kernels.kv_quant import FP8_DTYPE
from kvasir.kernels.workspace import MAX_DECODE_SPLITS
from kvasir.runtime.config import EngineConfig, ModelConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.layers.quantization.registry import online_quantizer
from kvasir.runtime.layers.quantization.report import weights_report
from kvasir.runtime.loader.model_files import ModelFiles, open_model
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.models.registry import get_model_class
from kvasir.runtime.outputs import SamplerOutput, StepResult, TokenLogprob
from kvasir.runtime.parallel.group import SINGLE, TensorParallel
from kvasir.runtime.parallel.partition import head_shard
from kvasir.runtime.parallel.tensors import broadcast_from_driver, min_over_ranks
from kvasir.runtime.parallel.topology import machine_kv_share
from kvasir.runtime.sample.persistent_rows import PersistentSamplingRows
from kvasir.runtime.sample.sampler import Sampler, SamplingBatch
from kvasir.runtime.spec_decode.config import SpeculativeConfig
from kvasir.runtime.spec_decode.draft_runner import DraftRunner
from kvasir.runtime.spec_decode.verification import verify_step
from kvasir.runtime.startup_phases import StartupPhases
from kvasir.runtime.structured.stats import StructuredStats
from kvasir.runtime.worker.block_table import PersistentBlockTable
from kvasir.runtime.worker.cuda_graphs import DecodeGraphRunner
from kvasir.runtime.worker.grammar_masks import GrammarMasks, PendingBitmask
from kvasir.runtime.worker.kernel_warmup import warm_up_kernels
from kvasir.runtime.worker.kv_budget import (
    bytes_per_block,
    check_fits,
    machine_memory_bytes,
    num_blocks_for_budget,
)
from kvasir.runtime.worker.lora_slots import LoRASlots, StepAdapters
from kvasir.runtime.worker.step_inputs import ModelInputs, build_step_inputs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, config: ModelConfig, device: torch.device
) -> torch.dtype:
    """The KV cache's element type.

    "auto": float16 on CPU for a float32 model that the C attention kernel runs (it converts as it
    reads: half the bytes to hold and to read per step, as llama.cpp's default f16 cache), else the
    model's dtype. A named float type must be the model's, or narrower than a float32 model's on
    CPU. "fp8": float8 e4m3.
    """
    cpu_kernel = device.type == "cpu" and cpu_attention.takes(
        model_dtype, torch.float16, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    )
    if kv_cache_dtype == "auto":
        return torch.float16 if cpu_kernel else model_dtype
    if kv_cache_dtype in _DTYPES:
        chosen = _DTYPES[kv_cache_dtype]
        if chosen != model_dtype and not (cpu_kernel and model_dtype == torch.float32):
            raise ValueError(
                f"--kv-cache-dtype {kv_cache_dtype} needs a {kv_cache_dtype} model, or a float32 one on "
                f"CPU; this model computes in {str(model_dtype).removeprefix('torch.')} on {device.type}"
            )
        return chosen
    if device.type == "cuda" and use_triton(device) and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"an fp8 KV cache needs a GPU with float8 support (compute capability 8.9+, Ada or "
            f"Hopper); {name} has {torch.cuda.get_device_capability(device)}: use --kv-cache-dtype auto"
        )
    return FP8_DTYPE


def load_model(
    files: ModelFiles, device: torch.device, dtype: torch.dtype, parallel: TensorParallel = SINGLE
) -> CausalLM:
    """Build the checkpoint's model class on `device` in `dtype` and fill it with its weights
    (kept packed in a quantized model: its layers build their kernels as the weights arrive).
    With a `parallel` of size N, this rank's share of the model, reading only its slices."""
    started = time.perf_counter()
    model_cls = get_model_class(files.config.architecture)
    with torch.device(device):
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(files.config, parallel)
        finally:
            torch.set_default_dtype(previous_dtype)
    quantize = online_quantizer(files.quantization.method) if files.quantization.at_load else None
    shards = model.weight_shards().get if parallel.size > 1 else None
    model.load_weights(files.iter_weights(shards), quantize)
    model.eval()
    logger.info(
        "loaded %s (%s, %s) in %.1fs; weights: %s",
        files.config.architecture,
        dtype,
        device,
        time.perf_counter() - started,
        weights_report(model, files.config.quantization).summary(),
    )
    return model


class ModelRunner:
    """Loads the model, allocates the KV cache (and CUDA graphs) and executes scheduler steps."""

    def __init__(
        self,
        config: EngineConfig,
        files: ModelFiles,
        phases: StartupPhases | None = None,
        structured_stats: StructuredStats | None = None,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        # This process's rank (--tensor-parallel-size): every rank builds a runner and is called
        # with the same arguments in the same order; the driver's results are the step's.
        self.parallel = parallel
        phases = phases or StartupPhases()
        self.model_config: ModelConfig = files.config
        # The attention shapes this rank runs and caches: its query heads and KV heads.
        self.rank_config = _rank_attention_config(self.model_config, parallel)
        self.device = resolve_device(config.device)
        # The kernels' backend is decided here, once: a bad KVASIR_KERNELS fails at start-up.
        self.use_triton = choose_backend(self.device)
        cpu_kernels_enabled()  # likewise a junk KVASIR_CPU_KERNELS, not at the first step
        logger.info("kernels: %s", "Triton" if self.use_triton else "torch reference")
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.rank_config, self.device
        )
        self.block_size = config.block_size
        self.max_model_len = config.context_length(self.model_config)
        self.max_num_batched_tokens = config.batched_tokens_on(self.device.type)

        with phases.phase("weights"):
            self.model = load_model(files, self.device, self.dtype, parallel)
            self.weights_report = weights_report(self.model, self.model_config.quantization)
            spec = config.speculative_config
            self.drafter = self._build_drafter(spec) if spec is not None and spec.method != "ngram" else None

        with phases.phase("kv_cache"):
            # LoRA slots (--enable-lora) come out of the KV cache's memory: allocated before it is sized.
            self.lora = (
                LoRASlots(config, self.model_config, self.device, self.dtype, self.model.weight_shards())
                if config.enable_lora
                else None
            )
            # Before the KV cache is sized, so the free memory it is carved from already excludes it.
            self.attention_workspace = self._attention_workspace()
            self.num_blocks = self._num_kv_blocks()
            cache_shape = (
                self.num_blocks,
                self.block_size,
                self.rank_config.num_key_value_heads,
                self.rank_config.head_dim,
            )
            # The CPU attention kernel reads only the slots below each request's length, all written
            # before they are read: its cache is left unwritten (torch.empty), so its pages become
            # resident as tokens fill them. Elsewhere padded blocks are read and masked: zeros, so an
            # unwritten NaN cannot leak through a zero attention weight.
            lazy = self.device.type == "cpu" and cpu_attention.takes(
                self.dtype,
                self.kv_cache_dtype,
                self.rank_config.num_attention_heads,
                self.rank_config.num_key_value_heads,
                self.rank_config.head_dim,
            )
            allocate = torch.empty if lazy else torch.zeros
            self.kv_caches = self._allocate_kv_caches(cache_shape, allocate)
        if self.drafter is not None:
            self.drafter.bind_kv_caches(self.kv_caches, self.num_blocks, self.kv_cache_dtype)
        self.sampler = Sampler()
        # Structured output's token bitmasks, filled while the forward pass runs.
        self.grammar_masks = GrammarMasks(self.model_config.vocab_size, self.device, structured_stats)
        # Requests' sampling parameters and block tables, written as they change, gathered per step.
        self.sampling_rows = PersistentSamplingRows(self.model_config.vocab_size, self.device)
        self.block_tables = PersistentBlockTable(capacity=config.max_num_seqs)
        if self.device.type == "cuda" and self.use_triton:
            # Compile the prefill kernels now, not during the first long request.
            with phases.phase("kernel_warmup"):
                warm_up_kernels(
                    self.model,
                    self.kv_caches,
                    block_size=self.block_size,
                    max_tokens=min(self.max_num_batched_tokens, self.max_model_len),
                    device=self.device,
                    workspace=self.attention_workspace,
                )
        if self.device.type == "cuda":
            with phases.phase("cuda_graphs"):
                self.decode_graphs = self._capture_decode_graphs()
        else:
            self.decode_graphs = None

    @property
    def kv_elements_per_token(self) -> int:
        """KV elements one token takes in every KV tensor of this rank: the target's (its KV heads)
        and a draft model's (whole on every rank)."""
        draft = self.drafter.kv_elements_per_token if self.drafter is not None else 0
        return self.rank_config.kv_elements_per_token + draft

    def _build_drafter(self, spec: SpeculativeConfig) -> DraftRunner:
        draft = None
        if spec.method == "draft_model":
            assert spec.model is not None  # SpeculativeConfig requires it for this method
            draft = load_model(
                open_model(spec.model, download_dir=self.config.download_dir, token=self.config.hf_token),
                self.device,
                self.dtype,
            )
        return DraftRunner(
            spec,
            self.model,
            draft,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            device=self.device,
        )

    def _num_kv_blocks(self) -> int:
        """The KV pool's size in blocks: --num-kv-blocks, else what the byte budget buys; a size
        the device's memory cannot hold is a ValueError naming the setting, not an allocator's."""
        itemsize = self.kv_cache_dtype.itemsize
        block_bytes = bytes_per_block(self.kv_elements_per_token, itemsize, self.block_size)
        memory: int | None
        # The LoRA slots are already allocated: on CUDA the free memory excludes them; on CPU they
        # are taken out of the byte budget and of the machine's memory here.
        lora_bytes = self.lora.nbytes if self.lora is not None and self.device.type != "cuda" else 0
        if self.device.type == "cuda":
            free_bytes, _total = torch.cuda.mem_get_info(self.device)
            memory, whose = free_bytes, f"the memory free on {self.device} after loading the weights"
        else:
            memory, whose = machine_memory_bytes(), "this machine's memory"
            memory = None if memory is None else memory - lora_bytes
        if self.config.num_kv_blocks is not None:
            setting, num_blocks = "--num-kv-blocks (KVASIR_NUM_KV_BLOCKS)", self.config.num_kv_blocks
        elif self.device.type == "cuda":
            setting = "--kv-cache-memory-fraction (KVASIR_KV_CACHE_MEMORY_FRACTION)"
            budget = int(free_bytes * self.config.kv_cache_memory_fraction)
            num_blocks = num_blocks_for_budget(self.kv_elements_per_token, itemsize, self.block_size, budget)
        else:
            setting = "--kv-cache-bytes (KVASIR_KV_CACHE_BYTES)"
            # The budget is each machine's (as vLLM's memory settings are each device's), cut
            # between the ranks on it by what a token takes on each (each cut buys the same blocks).
            budget = int(self.config.kv_cache_bytes * self._kv_budget_share()) - lora_bytes
            num_blocks = num_blocks_for_budget(self.kv_elements_per_token, itemsize, self.block_size, budget)
        check_fits(num_blocks, block_bytes, memory, whose, setting)
        self._kv_setting = setting
        # One scheduler (on rank 0) hands out blocks for every rank: each must hold them all.
        return min_over_ranks(self.parallel, num_blocks)

    def _kv_budget_share(self) -> float:
        """This rank's part of its machine's KV budget, which the ranks on that machine share
        (`machine_kv_share`; 1 at size 1)."""
        if self.parallel.size == 1:
            return 1.0
        draft = self.kv_elements_per_token - self.rank_config.kv_elements_per_token
        config = self.model_config
        every_rank = [
            _rank_attention_config(config, TensorParallel(rank, self.parallel.size)).kv_elements_per_token
            + draft
            for rank in range(self.parallel.size)
        ]
        return machine_kv_share(every_rank, self.parallel.rank, self.config.nnodes)

    def _allocate_kv_caches(
        self, shape: tuple[int, ...], allocate: Any
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of every layer; an allocation the device refuses is a ValueError naming the
        setting that sized it (memory other processes hold is not known in advance)."""
        try:
            return [
                (
                    allocate(shape, dtype=self.kv_cache_dtype, device=self.device),
                    allocate(shape, dtype=self.kv_cache_dtype, device=self.device),
                )
                for _ in range(self.model_config.num_hidden_layers)
            ]
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                f"{self._kv_setting}: cannot allocate a KV cache of {self.num_blocks} blocks on "
                f"{self.device}: {reason[:200]}; lower it"
            ) from None

    def _attention_workspace(self) -> AttentionWorkspace | None:
        """Split-K scratch for the Triton decode kernel; None where the torch reference runs."""
        if not self.use_triton:
            return None
        return AttentionWorkspace(
            max_requests=self.config.max_num_seqs,
            num_q_heads=self.rank_config.num_attention_heads,
            head_dim=self.rank_config.head_dim,
            max_splits=MAX_DECODE_SPLITS,
            device=self.device,
        )

    def _capture_decode_graphs(self) -> DecodeGraphRunner | None:
        """CUDA graphs for decode-only steps: only on CUDA with the Triton kernels, whose launches
        never sync with the host (the torch reference reads lengths back), and not when eager."""
        if self.device.type != "cuda":
            return None
        if self.config.enforce_eager:
            logger.info("CUDA graphs off (--enforce-eager): every step runs eagerly")
            return None
        if self.parallel.size > 1:
            # Not yet captured with the all-reduces inside (docs/tensor-parallel.md).
            logger.info(
                "CUDA graphs off: --tensor-parallel-size %d runs every step eagerly", self.parallel.size
            )
            return None
        if not self.use_triton:
            logger.info("CUDA graphs off: the torch reference kernels are not capturable")
            return None
        return DecodeGraphRunner(
            self.model,
            self.kv_caches,
            # A decode step has one token per request, so both limits bound its batch.
            max_batch_size=min(self.config.max_num_seqs, self.max_num_batched_tokens),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            workspace=self.attention_workspace,
            device=self.device,
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run the model over the scheduled tokens and sample where a prompt is complete; a
        request verifying drafts gets its accepted drafts plus one token."""
        if not any(item.spec_token_ids for item in plan.scheduled):
            return self.run_prepared(self.prepare_step(plan)).result
        self._forget_finished(plan)
        started = time.perf_counter()
        batch = self.prepare_inputs(plan)
        sampled = [item for item in plan.scheduled if item.sample]
        bitmask = None
        if self.parallel.is_driver:
            bitmask = self.grammar_masks.start(
                [item.request.grammar for item in sampled], [item.spec_token_ids for item in sampled]
            )
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices.to(self.device)])
        if not self.parallel.is_driver:
            # The driver verifies and answers; this rank's share (its KV heads) is written.
            return StepResult([], [], None, batch.num_tokens, time.perf_counter() - started)
        verified = verify_step(
            logits,
            sampled,
            self.model_config.vocab_size,
            self.device,
            None if bitmask is None else bitmask.tensor(),
        )
        emitted = [len(tokens) for tokens in verified.token_ids]
        return StepResult(
            [item.request_id for item in sampled],
            verified.token_ids,
            _token_logprobs(verified.output, verified.rows, emitted),
            batch.num_tokens,
            time.perf_counter() - started,
            verified.num_draft_tokens,
        )

    def prepare_step(self, plan: SchedulerOutput) -> PreparedStep:
        """The host's share of a step without drafts: flat inputs and sampling parameters, built
        on the CPU. With async scheduling it runs while the previous step is on the device."""
        self._forget_finished(plan)
        sampled = [item for item in plan.scheduled if item.sample]
        sampling = None
        if sampled:
            sampling = self.sampling_rows.build(
                [item.request for item in sampled], [item.pending_row >= 0 for item in sampled]
            )
        # The grammar masks need each request's latest token: a request with a grammar is never
        # planned ahead (`Scheduler.schedule_ahead`), so its state is current here. They apply
        # where the sampler runs: on the driver.
        bitmask = None
        if sampled and self.parallel.is_driver:
            bitmask = self.grammar_masks.start([item.request.grammar for item in sampled])
        return PreparedStep(
            self.prepare_inputs(plan), [item.request_id for item in sampled], sampling, bitmask
        )

    @torch.inference_mode()
    def run_prepared(self, step: PreparedStep, previous: StepOutcome | None = None) -> StepOutcome:
        """The device's share: the forward pass and the sampler. Placeholder inputs take the
        tokens `previous` sampled, read from its tensor where it lives (no host round trip)."""
        started = time.perf_counter()
        batch = step.inputs
        input_ids = batch.input_ids
        if batch.pending_positions is not None and batch.pending_rows is not None:
            if previous is None or previous.token_tensor is None:
                raise RuntimeError("a step with pending inputs needs the previous step's tokens")
            input_ids = input_ids.to(self.device)
            input_ids[batch.pending_positions.to(self.device)] = previous.token_tensor[
                batch.pending_rows.to(self.device)
            ]
        hidden = self._forward(batch, input_ids)
        if step.sampling is None:
            return StepOutcome(
                StepResult([], [], None, batch.num_tokens, time.perf_counter() - started), None
            )
        logits = self.model.compute_logits(hidden[batch.logits_indices.to(self.device)])
        if not self.parallel.is_driver:
            return self._receive_sampled(step, logits.device, started)
        sampling = step.sampling
        if step.bitmask is not None:
            sampling = dataclasses.replace(sampling, token_bitmask=step.bitmask.tensor())
        output = self.sampler(logits, sampling)
        tokens = output.token_tensor
        if self.parallel.size > 1:  # every rank's next step reads the tokens on its own device
            tokens = broadcast_from_driver(self.parallel, output.token_tensor.to(torch.int64))
        result = StepResult(
            step.request_ids,
            [[token_id] for token_id in output.token_ids],
            _token_logprobs(output, [1] * len(step.request_ids)),
            batch.num_tokens,
            time.perf_counter() - started,
            [0] * len(step.request_ids),
        )
        return StepOutcome(result, tokens)

    def _receive_sampled(self, step: PreparedStep, device: torch.device, started: float) -> StepOutcome:
        """Tensor parallelism, a rank other than the driver: the driver's sampled tokens, on this
        rank's device (the next step's placeholders read them there). Only the driver's result
        answers: this one lists nothing, so the rank never waits to read the tokens back."""
        tokens = torch.empty(len(step.request_ids), dtype=torch.int64, device=device)
        broadcast_from_driver(self.parallel, tokens)
        result = StepResult([], [], None, step.inputs.num_tokens, time.perf_counter() - started)
        return StepOutcome(result, tokens)

    def _forward(self, batch: ModelInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model over one flat batch (a captured graph for a decode step when one fits)."""
        input_ids = batch.input_ids if input_ids is None else input_ids
        if batch.adapters is not None and self.lora is not None:
            # Slots are assigned here, on the thread that runs steps in order; such a step runs
            # eagerly, layer by layer (no CUDA graph, no CPU decoder stack).
            attn = self.lora.bind_step(batch.adapters, batch.attn.to(self.device, self.attention_workspace))
            hidden = self.model(
                input_ids.to(self.device), batch.positions.to(self.device), self.kv_caches, attn
            )
        elif self.decode_graphs is not None and self.decode_graphs.can_run(batch.attn):
            hidden = self.decode_graphs.run(input_ids, batch.positions, batch.attn)
        else:
            attn = batch.attn.to(self.device, self.attention_workspace)
            hidden = self.model(
                input_ids.to(self.device), batch.positions.to(self.device), self.kv_caches, attn
            )
        if self.drafter is not None and self.drafter.needs_mirror:
            # A draft model sees every token the target computes, graph-replayed steps included.
            self.drafter.mirror(
                input_ids.to(self.device),
                batch.positions.to(self.device),
                batch.attn.to(self.device, self.attention_workspace),
            )
        return hidden

    @torch.inference_mode()
    def propose_drafts(
        self, last_token_ids: list[int], num_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        """Draft tokens from the model-based drafter for requests whose newest token is known."""
        if self.drafter is None:
            raise RuntimeError("no model-based drafter is configured")
        return self.drafter.propose(last_token_ids, num_tokens, block_tables, self.attention_workspace)

    def prepare_inputs(self, plan: SchedulerOutput) -> ModelInputs:
        """The step's flattened batch as CPU tensors (the caller moves them where they are read)."""
        inputs = build_step_inputs(plan, self.block_size, self.block_tables.gather(plan.scheduled))
        if self.lora is None:
            return inputs
        adapters = StepAdapters.from_plan(plan)
        return inputs if adapters is None else dataclasses.replace(inputs, adapters=adapters)

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter's files into host memory, in the calling thread (any thread but
        the engine's); raises LoRAAdapterError, or RuntimeError without --enable-lora."""
        self._lora_slots().add(lora)

    def remove_lora(self, adapter_id: int) -> None:
        """Forget an adapter (any thread); its slot is reused from the next step on."""
        self._lora_slots().remove(adapter_id)

    def prefetch_loras(self, loras: list[LoRARequest]) -> None:
        """Read in the background the adapters of `loras` not in host memory (any thread)."""
        self._lora_slots().prefetch(loras)

    def _lora_slots(self) -> LoRASlots:
        if self.lora is None:
            raise RuntimeError("LoRA adapters need --enable-lora")
        return self.lora

    def _forget_finished(self, plan: SchedulerOutput) -> None:
        """Free the persistent rows of requests that finished since the previous step."""
        self.sampling_rows.release(plan.finished_request_ids)
        self.block_tables.release(plan.finished_request_ids)


def _rank_attention_config(config: ModelConfig, parallel: TensorParallel) -> ModelConfig:
    """`config` with this rank's query and KV heads (the KV cache's and attention kernels' shapes);
    `config` itself at size 1."""
    if parallel.size == 1:
        return config
    heads = head_shard(parallel, config.num_attention_heads, config.num_key_value_heads)
    return dataclasses.replace(
        config, num_attention_heads=heads.num_heads, num_key_value_heads=heads.num_kv_heads
    )


def _token_logprobs(
    output: SamplerOutput, rows_per_request: list[int], emitted_per_request: list[int] | None = None
) -> list[list[TokenLogprob]] | None:
    """Per request, the logprob entries of its emitted tokens (its first rows); None when none asked."""
    if output.logprobs is None:
        return None
    top = output.top_logprobs or [[] for _ in output.token_ids]
    result, row = [], 0
    emitted = emitted_per_request or rows_per_request
    for num_rows, num_emitted in zip(rows_per_request, emitted, strict=True):
        result.append(
            [
                TokenLogprob(output.token_ids[r], output.logprobs[r], tuple(top[r]))
                for r in range(row, row + num_emitted)
            ]
        )
        row += num_rows
    return result


@dataclass(frozen=True)
class PreparedStep:
    """A step's CPU-side inputs, ready for `ModelRunner.run_prepared`."""

    inputs: ModelInputs
    request_ids: list[str]  # the requests sampled this step, in row order
    sampling: SamplingBatch | None  # None: nothing is sampled (prefill chunks only)
    bitmask: PendingBitmask | None = None  # structured output's masks, being filled


@dataclass(frozen=True)
class StepOutcome:
    """What a step produced: the host's copy, and the sampled tokens where they were made (the
    next step's placeholders read them from there)."""

    result: StepResult
    token_tensor: torch.Tensor | None
