"""A request's state as it moves through the scheduler: tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvasir.runtime.core.kv_cache.block_hash import request_extra_key
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams

if TYPE_CHECKING:
    from kvasir.runtime.core.scheduler_output import OutputGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; resumes by recompute
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"  # cancelled by the client or the server

    # Members are singletons compared by identity, so identity hashing is exact, and it runs in C:
    # Enum's own __hash__ (hash of the name, in Python) made `finished` a hot spot of every step.
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` for a finished status, None while unfinished."""
        return self.value if self.finished else None


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.monotonic()) the serving layer turns into latency metrics."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Request:
    """One sequence being generated. `n > 1` is fanned out into one Request per choice."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        seed: int,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        grammar: OutputGrammar | None = None,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Resolved limits: max_tokens already clipped to the context length, and a concrete seed
        # (drawn by the engine when the client gave none) so sampling is reproducible per request.
        self.max_tokens = max_tokens
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        # prompt + output, kept as one list so scheduling and hashing never concatenate.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        # Draft tokens proposed for the next step (speculative decoding); the scheduler takes them.
        self.spec_token_ids: list[int] = []
        # Chained hashes of this request's full blocks, extended by the KV cache manager.
        self.block_hashes: list[bytes] = []
        self.times = RequestTimes(arrival=time.monotonic() if arrival_time is None else arrival_time)
        # Structured output: the grammar state, advanced with every output token (None: free text).
        self.grammar = grammar
        # The LoRA adapter the request runs with (None: the base model).
        self.lora = lora
        # The client's `cache_salt`: prefix-cache hits only among requests with the same salt.
        self.cache_salt = cache_salt
        # What every block hash of this request includes besides its tokens (adapter, salt).
        self.cache_key = request_extra_key(None if lora is None else lora.cache_key, cache_salt)
        # Steps this request was passed over, waiting, because its adapter found no slot.
        self.lora_skips = 0

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
