"""The model runner: owns the weights and the paged KV cache tensors, and runs one step.

All tensor work of a step happens here: the scheduler's plan becomes a flattened batch
(`input_ids`, `positions`, attention metadata), the model runs once over it, and the sampler picks
one token for every request whose prompt is now fully computed. On CUDA with the Triton kernels,
decode-only steps replay captured CUDA graphs (`kvasir.runtime.worker.cuda_graphs`) instead.
"""

from __future__ import annotations

import logging
import time

import torch

from kvasir.kernels import AttentionWorkspace
from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.kv_quant import FP8_DTYPE
from kvasir.kernels.workspace import MAX_DECODE_SPLITS
from kvasir.runtime.config import EngineConfig, ModelConfig
from kvasir.runtime.core.scheduler import SchedulerOutput
from kvasir.runtime.loader.model_files import ModelFiles
from kvasir.runtime.models.registry import get_model_class
from kvasir.runtime.outputs import SamplerOutput, StepResult, TokenLogprob
from kvasir.runtime.sample.sampler import Sampler, SamplingBatch
from kvasir.runtime.worker.cuda_graphs import DecodeGraphRunner
from kvasir.runtime.worker.kernel_warmup import warm_up_kernels
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
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's element type: the model's, or float8 e4m3 for "fp8"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if device.type == "cuda" and use_triton(device) and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"an fp8 KV cache needs a GPU with float8 support (compute capability 8.9+, Ada or "
            f"Hopper); {name} has {torch.cuda.get_device_capability(device)}: use --kv-cache-dtype auto"
        )
    return FP8_DTYPE


class ModelRunner:
    """Loads the model, allocates the KV cache (and CUDA graphs) and executes scheduler steps."""

    def __init__(self, config: EngineConfig, files: ModelFiles) -> None:
        self.config = config
        self.model_config: ModelConfig = files.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.max_num_batched_tokens = config.batched_tokens_on(self.device.type)

        started = time.perf_counter()
        model_cls = get_model_class(self.model_config.architecture)
        with torch.device(self.device):
            previous_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = model_cls(self.model_config)
            finally:
                torch.set_default_dtype(previous_dtype)
        self.model.load_weights(files.iter_weights())
        self.model.eval()
        logger.info(
            "loaded %s (%s, %s) in %.1fs",
            self.model_config.architecture,
            self.dtype,
            self.device,
            time.perf_counter() - started,
        )

        # Before the KV cache is sized, so the free memory it is carved from already excludes it.
        self.attention_workspace = self._attention_workspace()
        self.num_blocks = self._num_kv_blocks()
        cache_shape = (
            self.num_blocks,
            self.block_size,
            self.model_config.num_key_value_heads,
            self.model_config.head_dim,
        )
        self.kv_caches = [
            (
                torch.zeros(cache_shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(cache_shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(self.model_config.num_hidden_layers)
        ]
        self.sampler = Sampler()
        if self.device.type == "cuda" and use_triton(self.device):
            # Compile the prefill kernels now, not during the first long request.
            warm_up_kernels(
                self.model,
                self.kv_caches,
                block_size=self.block_size,
                max_tokens=min(self.max_num_batched_tokens, self.max_model_len),
                device=self.device,
                workspace=self.attention_workspace,
            )
        self.decode_graphs = self._capture_decode_graphs()

    @property
    def kv_bytes_per_block(self) -> int:
        element_size = self.kv_cache_dtype.itemsize
        return self.model_config.kv_bytes_per_token * element_size * self.block_size

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free_bytes, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * self.config.kv_cache_memory_fraction)
        else:
            budget = self.config.kv_cache_bytes
        num_blocks = budget // self.kv_bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.kv_bytes_per_block} "
                "bytes; raise --kv-cache-bytes / --kv-cache-memory-fraction"
            )
        return num_blocks

    def _attention_workspace(self) -> AttentionWorkspace | None:
        """Split-K scratch for the Triton decode kernel; None where the torch reference runs."""
        if not use_triton(self.device):
            return None
        return AttentionWorkspace(
            max_requests=self.config.max_num_seqs,
            num_q_heads=self.model_config.num_attention_heads,
            head_dim=self.model_config.head_dim,
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
        if not use_triton(self.device):
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
        """Run the model over the scheduled tokens and sample where a prompt is complete."""
        started = time.perf_counter()
        batch = self.prepare_inputs(plan)
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch.attn):
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.attn)
        else:
            attn = batch.attn.to(self.device, self.attention_workspace)
            input_ids, positions = batch.input_ids.to(self.device), batch.positions.to(self.device)
            hidden = self.model(input_ids, positions, self.kv_caches, attn)
        sampled_requests = [item.request for item in plan.scheduled if item.sample]
        if not sampled_requests:
            return StepResult([], [], None, batch.num_tokens, time.perf_counter() - started)
        logits = self.model.compute_logits(hidden[batch.logits_indices.to(self.device)])
        sampling = SamplingBatch.build(sampled_requests, self.model_config.vocab_size, self.device)
        output = self.sampler(logits, sampling)
        return StepResult(
            [request.request_id for request in sampled_requests],
            [[token_id] for token_id in output.token_ids],
            _token_logprobs(output),
            batch.num_tokens,
            time.perf_counter() - started,
        )

    def prepare_inputs(self, plan: SchedulerOutput) -> ModelInputs:
        """The step's flattened batch as CPU tensors (the caller moves them where they are read)."""
        return build_step_inputs(plan, self.block_size)


def _token_logprobs(output: SamplerOutput) -> list[list[TokenLogprob]] | None:
    """One row's sampled-token logprob and top alternatives per request; None when none asked."""
    if output.logprobs is None:
        return None
    top = output.top_logprobs or [[] for _ in output.token_ids]
    return [
        [TokenLogprob(token_id, logprob, tuple(alternatives))]
        for token_id, logprob, alternatives in zip(output.token_ids, output.logprobs, top, strict=True)
    ]
