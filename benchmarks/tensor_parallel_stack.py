"""The fused CPU decoder stack at TP=2: a decode step with it against the layers run one by one.

    python benchmarks/tensor_parallel_stack.py                  # batch 1 and 32, 3 rounds
    python benchmarks/tensor_parallel_stack.py --batches 1 8 32 --tokens 32 --rounds 5

Method. Two ranks are spawned and joined in a gloo group (loopback); each runs one torch thread
(the cores are shared by both) and builds two `ModelRunner`s over its shard of the embedded model
(SmolLM2-135M, Q4_1 GGUF kept packed): `stack` bound to the C decoder stack (the default, one C
call for the rank's layers, calling back for the two all-reduces a layer) and `layers` bound with
`KVASIR_CPU_DECODER_STACK=0` (each layer's kernels called from Python, the all-reduces from the
row-parallel layers). Both are in the same processes and alternate within each round, so a ratio
compares them under the same load. Each rank runs its own scheduler over the same requests (rank
0's step results are broadcast so every scheduler advances alike, as the engine mirrors rank 0's
plans); a round generates `--tokens` greedy tokens for `batch` requests of 16-token prompts with
each runner in turn. A decode step is one `ModelRunner.execute` on rank 0 (wall clock: it includes
waiting for rank 1 at each collective, which is what the step costs); medians over every decode
step of the rounds after a warm-up round.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table

VARIANTS = ("stack", "layers")
PROMPT_TOKENS = 16
SIZE = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request and round")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def build_runner(parallel: Any, stack: bool, max_seqs: int, tokens: int) -> Any:
    """A runner over this rank's shard, bound to the stack or not (the switch is read when the
    model binds, at its first step: that step is run here, under the switch)."""
    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.loader.embedded import embedded_model_path
    from kvasir.runtime.loader.model_files import open_model
    from kvasir.runtime.models.cpu_decoder_stack import DISABLE_ENV
    from kvasir.runtime.worker.model_runner import ModelRunner

    os.environ[DISABLE_ENV] = "1" if stack else "0"
    model = str(embedded_model_path())
    config = EngineConfig(
        model=model, device="cpu", max_model_len=PROMPT_TOKENS + tokens + 16, max_num_seqs=max_seqs,
        kv_cache_bytes=256 << 20,
    )  # fmt: skip
    runner = ModelRunner(config, open_model(model), parallel=parallel)
    decode(runner, parallel, 1, 2)  # binds the model under the switch
    os.environ.pop(DISABLE_ENV)
    if (runner.model.model._cpu_stack is not None) != stack:
        raise RuntimeError(f"the {'stack' if stack else 'layers'} runner did not bind as asked")
    return runner


def decode(runner: Any, parallel: Any, batch: int, tokens: int) -> list[float]:
    """`batch` requests of `tokens` greedy tokens; the wall seconds of each decode step's execute."""
    from kvasir.runtime.core.kv_cache.manager import KVCacheManager
    from kvasir.runtime.core.request import Request
    from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
    from kvasir.runtime.sample.params import SamplingParams

    config = runner.config
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(batch * PROMPT_TOKENS, 64), max_num_seqs=batch,
            max_model_len=config.max_model_len, block_size=config.block_size,
        ),
        KVCacheManager(runner.num_blocks, config.block_size),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(PROMPT_TOKENS)]
        scheduler.add_request(Request(f"r{i}", prompt, params, max_tokens=tokens, seed=0))
    seconds = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        started = time.perf_counter()
        result = runner.execute(plan)
        seconds.append(time.perf_counter() - started)
        result = parallel.broadcast_object(result if parallel.is_driver else None)
        sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
        scheduler.update(plan, sampled, time.monotonic())
    return seconds[1:]  # the first step is the prompts'


def rank_main(rank: int, store: str, args: argparse.Namespace, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from kvasir.runtime.parallel.group import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, SIZE), rank=rank, world_size=SIZE)
    parallel = TensorParallel(rank=rank, size=SIZE, group=dist.group.WORLD, cpu_group=dist.group.WORLD)
    runners = {
        name: build_runner(parallel, name == "stack", max(args.batches), args.tokens) for name in VARIANTS
    }
    kept: dict[str, list[float]] = {}
    for round_index in range(args.rounds + 1):  # the first round warms up and is not kept
        for batch in args.batches:
            for name, runner in runners.items():
                steps = decode(runner, parallel, batch, args.tokens)
                if round_index:
                    kept.setdefault(f"{name}/{batch}", []).extend(steps)
    if rank == 0:
        results.update(kept)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    print_header("The fused CPU decoder stack at TP=2 (gloo): against the layers one by one", sys.argv)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch, context.Manager() as manager:
        results = manager.dict()
        ranks = [
            context.Process(target=rank_main, args=(rank, str(Path(scratch) / "store"), args, results))
            for rank in range(SIZE)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(process.exitcode != 0 for process in ranks):
            raise SystemExit(f"a rank failed: exit codes {[process.exitcode for process in ranks]}")
        kept = dict(results)
    rows = []
    for batch in args.batches:
        stack, layers = (statistics.median(kept[f"{name}/{batch}"]) for name in VARIANTS)
        rows.append([batch, f"{layers * 1e3:.2f}", f"{stack * 1e3:.2f}", f"{layers / stack:.2f}",
                     len(kept[f"stack/{batch}"])])  # fmt: skip
    print("rank threads: 1 each; model: the embedded SmolLM2-135M Q4_1 GGUF; times: rank 0's wall clock")
    print_table(["batch", "TP=2 layers ms", "TP=2 stack ms", "layers / stack", "steps each"], rows)


if __name__ == "__main__":
    main()
