"""Run a model split across ranks in spawned processes, for the sharding tests.

`run_ranks(world_size, jobs, tmp_path)` starts one process per rank (spawned: no state shared
with pytest), joins them into a gloo group through a FileStore, and has every rank run every job;
each rank saves its results to `tmp_path/<job>-rank<r>.pt`, read back with `load`. Children are
always joined, and killed if they outlive the timeout, so nothing is left running.

A job drives the model the two ways the runtime does: `model_logits` over a paged KV cache
(logits of full prompts, then of chunks, then decode steps, as `PagedRunner` does at size 1), and
`runner_greedy` through a real `ModelRunner` with a scheduler on every rank (each rank plans the
same steps from the same requests, as rank 0's plans are mirrored in the server; the driver's
step results, which only it produces in full, are broadcast to every rank's scheduler).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Children run one torch thread each: the machine's cores are shared by both ranks and pytest.
THREADS_PER_RANK = 1
JOIN_TIMEOUT_S = 240.0
BLOCK_SIZE = 4
REPOSITORY = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Job:
    name: str
    model: str  # a checkpoint folder or a .gguf file
    prompts: tuple[tuple[int, ...], ...]
    decode_steps: int = 4
    runner: bool = True  # also generate greedily through ModelRunner
    logits: bool = True  # the logits over a paged KV cache
    logits_again: bool = True  # ... and a second pass over them, to compare the bits
    kv_bytes: int = 1 << 20  # rank r's KV budget in ModelRunner is (r + 1) times this
    # --speculative-config for the ModelRunner run (drafts proposed by `DraftProposer`)
    speculative: dict[str, Any] | None = None
    # A PEFT adapter folder of rank 4: --enable-lora, and the even-numbered requests (and prompts
    # of `model_logits`) run with it
    lora: str | None = None


def run_ranks(world_size: int, jobs: list[Job], tmp_path: Path) -> None:
    """Run `jobs` on `world_size` spawned ranks; AssertionError with a rank's traceback if one fails."""
    context = multiprocessing.get_context("spawn")
    store = tmp_path / "store"
    children = [
        context.Process(target=_rank_main, args=(rank, world_size, str(store), jobs, str(tmp_path)))
        for rank in range(world_size)
    ]
    try:
        with _tests_importable():
            for child in children:
                child.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for child in children:
            child.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join(10)
    for rank, child in enumerate(children):
        error = tmp_path / f"error-rank{rank}.txt"
        if error.exists():
            raise AssertionError(f"rank {rank} failed:\n{error.read_text()}")
        assert child.exitcode == 0, f"rank {rank} exited with {child.exitcode} (killed after the timeout?)"


@contextlib.contextmanager
def _tests_importable() -> Iterator[None]:
    """Let spawned children import this module (`tests.runtime.parallel.sharded_ranks`, where their
    target lives). The suite runs with PYTHONSAFEPATH and pytest's importlib mode, so the
    repository root is on no sys.path, and a spawned child starts from its parent's sys.path:
    the root is appended while the children start (last: `operator/` never shadows the standard
    library's `operator`), then removed from this process's path."""
    root = str(REPOSITORY)
    added = root not in sys.path
    if added:
        sys.path.append(root)
    try:
        yield
    finally:
        if added:
            sys.path.remove(root)


def load(tmp_path: Path, job: str, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(tmp_path / f"{job}-rank{rank}.pt")
    return result


def _rank_main(rank: int, world_size: int, store: str, jobs: list[Job], out: str) -> None:
    import torch.distributed as dist

    from kvasir.runtime.parallel.group import TensorParallel

    torch.set_num_threads(THREADS_PER_RANK)
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size
        )
        group = dist.group.WORLD
        parallel = TensorParallel(rank=rank, size=world_size, group=group, cpu_group=group)
        for job in jobs:
            torch.save(run_job(job, parallel), Path(out) / f"{job.name}-rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    # As a rank's process does (engine/ranks/rank_main.py): the interpreter's own exit can abort in
    # torch's gloo teardown ("terminate called without an active exception", exit -6; CI saw it
    # here), after every result is written, which says nothing about the results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(job: Job, parallel: Any) -> dict[str, Any]:
    """Everything the tests compare, for one model on this rank (`parallel` may be SINGLE)."""
    from kvasir.runtime.layers.quantization.report import weights_report
    from kvasir.runtime.loader.model_files import open_model
    from kvasir.runtime.worker.model_runner import load_model

    files = open_model(job.model)
    resident = _resident_bytes()
    model = load_model(files, torch.device("cpu"), torch.float32, parallel)
    result: dict[str, Any] = {
        "weight_bytes": weights_report(model, files.config.quantization).weight_bytes,
        # How far loading raised this process's peak resident memory (meaningful for the first
        # job of a fresh process: the peak is the process's, over its whole life).
        "load_peak_bytes": _peak_resident_bytes() - resident,
    }
    if job.logits:
        # Whether each forward pass ran in the fused CPU decoder stack (not layer by layer).
        stack_steps: list[bool] = []
        body: Any = model.model  # LlamaModel
        run_stack = body._run_cpu_stack

        def counted(*args: Any) -> Any:
            stacked = run_stack(*args)
            stack_steps.append(stacked is not None)
            return stacked

        body._run_cpu_stack = counted
        result["logits"] = model_logits(model, job)
        if job.logits_again:
            result["logits_again"] = model_logits(model, job)
        result["stack_steps"] = stack_steps
    del model
    if job.runner:
        result.update(runner_greedy(job, parallel))
    return result


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    """This address space's high-water mark (VmHWM). Not getrusage's ru_maxrss: Linux carries that
    across exec, so a process spawned by a large pytest starts with pytest's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def model_logits(model: Any, job: Job) -> list[torch.Tensor]:
    """Logits of every prompt in one batch, then of `decode_steps` greedy decode steps for all;
    with `job.lora`, the even-numbered prompts run the adapter (from this rank's slot pool)."""
    from tests.runtime.models.paged_runner import PagedRunner

    runner = PagedRunner(model, num_blocks=128)
    attach = None if job.lora is None else _lora_rows(model, job.lora)
    attention = model.model.layers[0].self_attn.attn
    shape = (128, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
    generator = torch.Generator().manual_seed(0)
    # This rank's KV heads; garbage, not zeros, as PagedRunner's own.
    runner.kv_caches = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in model.model.layers
    ]
    prompts = [list(prompt) for prompt in job.prompts]
    chunks = [(r, p, 0) for r, p in enumerate(prompts)]
    logits = runner.step(chunks, None if attach is None else attach(chunks))
    steps = [torch.stack([rows[-1] for rows in logits])]
    for _ in range(job.decode_steps):
        tokens = [int(row.argmax()) for row in steps[-1]]
        chunks = [(r, [tokens[r]], len(prompts[r])) for r in range(len(prompts))]
        for r, token in enumerate(tokens):
            prompts[r].append(token)
        rows = runner.step(chunks, None if attach is None else attach(chunks))
        steps.append(torch.stack([last[-1] for last in rows]))
    return [torch.cat([rows for rows in logits]), *steps]


def _lora_rows(model: Any, adapter: str) -> Callable[[list[tuple[int, list[int], int]]], Any]:
    """`attach(chunks)` for `PagedRunner.step`: the adapter at `adapter` (rank 4) on every row of
    the even-numbered requests, from a slot pool holding this rank's share of it, as the worker's."""
    import numpy as np

    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.lora.params import LoRARequest
    from kvasir.runtime.worker.lora_slots import LoRASlots, StepAdapters

    config = EngineConfig(model=adapter, enable_lora=True, max_lora_rank=8)
    shards = model.weight_shards() if model.parallel.size > 1 else None
    slots = LoRASlots(config, model.config, torch.device("cpu"), torch.float32, shards)
    lora = LoRARequest("adapter", 1, adapter, b"adapter", rank=4)
    slots.add(lora)

    def attach(chunks: list[tuple[int, list[int], int]]) -> Any:
        rows = np.concatenate(
            [np.full(len(tokens), 0 if request % 2 == 0 else -1, np.int64) for request, tokens, _ in chunks]
        )
        return lambda attn: slots.bind_step(StepAdapters((lora,), rows), attn)

    return attach


def runner_greedy(job: Job, parallel: Any) -> dict[str, Any]:
    """Greedy generation through ModelRunner and a scheduler: the tokens, every step's sampled
    token tensor, and the KV blocks agreed (each rank offers a different budget)."""
    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.core.kv_cache.manager import KVCacheManager
    from kvasir.runtime.core.request import Request
    from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
    from kvasir.runtime.loader.model_files import open_model
    from kvasir.runtime.lora.params import LoRARequest
    from kvasir.runtime.sample.params import SamplingParams
    from kvasir.runtime.spec_decode.config import parse_speculative_config
    from kvasir.runtime.spec_decode.proposer import DraftProposer
    from kvasir.runtime.worker.model_runner import ModelRunner

    # Rank r offers (r + 1) x kv_bytes for its KV cache: every rank must settle on rank 0's count.
    config = EngineConfig(
        model=job.model,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=16,
        kv_cache_bytes=(parallel.rank + 1) * job.kv_bytes,
        speculative_config=None if job.speculative is None else parse_speculative_config(job.speculative),
        enable_lora=job.lora is not None,
        max_lora_rank=8,
    )
    runner = ModelRunner(config, open_model(job.model), parallel=parallel)
    adapter = None
    if job.lora is not None:
        adapter = LoRARequest("adapter", 1, job.lora, b"adapter", rank=4)
        runner.add_lora(adapter)
    drafts = DraftProposer.create(config.speculative_config, runner)
    kv_cache = KVCacheManager(runner.num_blocks, 16)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=8,
            max_model_len=128,
            block_size=16,
            num_lookahead_tokens=drafts.num_lookahead_tokens,
            max_loras=config.max_loras if adapter is not None else 0,
        ),
        kv_cache,
    )
    params = SamplingParams(temperature=0.0, max_tokens=job.decode_steps + 1, ignore_eos=True)
    for index, prompt in enumerate(job.prompts):
        lora = adapter if index % 2 == 0 else None
        scheduler.add_request(
            Request(f"r{index}", list(prompt), params, max_tokens=params.max_tokens or 1, seed=0, lora=lora)
        )
    tokens: dict[str, list[int]] = {}
    token_tensors = []
    num_draft_tokens = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        if drafts.enabled:
            result = runner.execute(plan)
        else:
            outcome = runner.run_prepared(runner.prepare_step(plan))
            if outcome.token_tensor is not None:
                token_tensors.append(outcome.token_tensor.clone())
            result = outcome.result
        result = parallel.broadcast_object(result if parallel.is_driver else None)
        num_draft_tokens += sum(result.num_draft_tokens or [])
        sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
        for request_id, new in sampled.items():
            tokens.setdefault(request_id, []).extend(new)
        updated = scheduler.update(plan, sampled, time.monotonic())
        if drafts.enabled:
            drafts.after_step(result, updated, plan.finished_request_ids, kv_cache)
    k_cache = runner.kv_caches[0][0]
    return {
        "runner_stack_bound": getattr(runner.model.model, "_cpu_stack", None) is not None,
        "tokens": tokens,
        "token_tensors": token_tensors,
        "num_draft_tokens": num_draft_tokens,
        "num_blocks": runner.num_blocks,
        "kv_bytes": config.kv_cache_bytes,
        "kv_share": runner._kv_budget_share(),
        "kv_cache_shape": tuple(k_cache.shape),
        "kv_block_bytes": k_cache[0].numel() * k_cache.element_size() * 2 * len(runner.kv_caches),
    }
