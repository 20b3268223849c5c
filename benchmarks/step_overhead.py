"""Host-side time of one engine decode step at batch 256, by component, with a tiny model.

On a GPU the model's work runs asynchronously, but everything the engine does in Python per step
(schedule, build the inputs, pack sampling parameters, update, detokenize) is time the GPU waits
for in a synchronous loop. With a tiny model (2 layers, hidden 64) the step is nearly all of that
host work, so this measures it on any machine. Each component is reported in ms per step and as a
share of the whole step measured in the same run.
"""

from __future__ import annotations

import argparse
import collections
import functools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import print_header, print_table
from _random_model import ModelShape, random_model_files

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.core import scheduler
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.output import processor as output_processor
from kvasir.runtime.sample import metadata as sampling_metadata
from kvasir.runtime.sample import sampler
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.sample.persistent_rows import PersistentSamplingRows
from kvasir.runtime.worker import model_runner
from kvasir.runtime.worker.step_inputs import build_step_inputs

TINY = ModelShape(
    label="tiny Llama",
    architecture="LlamaForCausalLM",
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=1000,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)
COMPONENTS: list[tuple[Any, str]] = [
    (scheduler.Scheduler, "schedule"),
    (model_runner.ModelRunner, "prepare_inputs"),
    (PersistentSamplingRows, "build"),
    (sampling_metadata.SamplingBatch, "build"),
    (model_runner.ModelRunner, "execute"),
    (sampler.Sampler, "__call__"),
    (scheduler.Scheduler, "update"),
    (output_processor.OutputProcessor, "process"),
]


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started

    return wrapper


def per_request_inputs(plan: Any, block_size: int) -> tuple[Any, ...]:
    """The baseline: the per-request input builder the runner used before `build_step_inputs`
    (several small numpy calls per request), kept here to measure against in the same run."""
    import numpy as np

    tokens, positions, slots, query_lens, seq_lens, logits_rows = [], [], [], [], [], []
    block_table = np.zeros(
        (len(plan.scheduled), max(len(i.block_ids) for i in plan.scheduled)), dtype=np.int32
    )
    offset = 0
    for row, item in enumerate(plan.scheduled):
        start, count = item.start, item.num_tokens
        tokens.append(item.request.all_token_ids[start : start + count])
        pos = np.arange(start, start + count, dtype=np.int64)
        blocks = np.asarray(item.block_ids, dtype=np.int64)
        block_table[row, : len(blocks)] = blocks
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        query_lens.append(count)
        seq_lens.append(start + count)
        offset += count
        if item.sample:
            logits_rows.append(offset - 1)
    starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=starts[1:])
    ids = np.fromiter((t for chunk in tokens for t in chunk), dtype=np.int64, count=offset)
    return (
        torch.from_numpy(ids),
        torch.from_numpy(np.concatenate(positions)),
        torch.from_numpy(np.concatenate(slots)),
        torch.from_numpy(block_table),
        torch.from_numpy(starts),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(logits_rows, dtype=torch.int64),
    )


def compare_input_builders(engine: LLMEngine, repeats: int = 50) -> list[list[Any]]:
    """Both builders on the same decode plan of the running batch (the engine is not stepped after)."""
    plan = engine.scheduler.schedule()
    new = engine.runner.prepare_inputs(plan)
    old = per_request_inputs(plan, engine.config.block_size)
    assert torch.equal(new.input_ids, old[0]) and torch.equal(new.attn.slot_mapping, old[2])
    return _against_baseline(
        {
            "per request (baseline)": lambda: per_request_inputs(plan, engine.config.block_size),
            "build_step_inputs, block table rebuilt": lambda: build_step_inputs(
                plan, engine.config.block_size
            ),
            "build_step_inputs, persistent block table": lambda: engine.runner.prepare_inputs(plan),
        },
        repeats,
    )


def compare_sampling_batches(engine: LLMEngine, repeats: int = 50) -> list[list[Any]]:
    """The step's sampling parameters packed afresh (the baseline) and gathered from persistent rows."""
    requests = list(engine.scheduler.running)
    device = engine.runner.device
    vocab_size = engine.runner.model_config.vocab_size
    rows = engine.runner.sampling_rows
    return _against_baseline(
        {
            "SamplingBatch.build (baseline)": lambda: sampling_metadata.SamplingBatch.build(
                requests, vocab_size, device
            ),
            "PersistentSamplingRows.build": lambda: rows.build(requests),
        },
        repeats,
    )


def _against_baseline(builders: dict[str, Callable[[], Any]], repeats: int) -> list[list[Any]]:
    """ms per call of each builder, and its speedup over the first one, measured in this run."""
    times = {}
    for name, fn in builders.items():
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        times[name] = (time.perf_counter() - started) / repeats * 1e3
    base = next(iter(times.values()))
    return [[name, ms, base / ms] for name, ms in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sampling", choices=["greedy", "top-p"], default="greedy")
    args = parser.parse_args()
    torch.set_num_threads(1)  # before the header, which reports it
    print_header("Host-side time per decode step", sys.argv)

    totals: dict[str, float] = collections.defaultdict(float)
    for owner, attr in COMPONENTS:
        name = f"{owner.__name__}.{attr}"
        setattr(owner, attr, _timed(totals, name, getattr(owner, attr)))

    max_len = args.prompt_len + args.steps + 104
    config = EngineConfig(
        model="random",
        device="cpu",
        dtype="float32",
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(8192, args.batch),
        num_kv_blocks=args.batch * (-(-max_len // 16) + 1),
        max_model_len=max_len,
    )
    engine = LLMEngine(config, random_model_files(TINY, torch.device("cpu"), torch.float32, seed=0))
    rng = random.Random(0)
    for i in range(args.batch):
        params = (
            SamplingParams(temperature=0.0, max_tokens=args.steps + 100, ignore_eos=True)
            if args.sampling == "greedy"
            else SamplingParams(
                temperature=0.8, top_p=0.9, max_tokens=args.steps + 100, ignore_eos=True, seed=i
            )
        )
        prompt = [rng.randrange(4, TINY.vocab_size) for _ in range(args.prompt_len)]
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    while engine.stats().num_waiting or not engine.scheduler.running:
        engine.step()  # prefill every prompt; time decode steps only
    engine.step()
    totals.clear()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - started) / args.steps * 1e3

    print(
        f"batch {args.batch}, context ~{args.prompt_len} tokens, {args.sampling} sampling, {args.steps} steps\n"
    )
    rows = [["engine.step (all)", step_ms, 1.0]]
    for name, total in sorted(totals.items(), key=lambda item: -item[1]):
        rows.append([name, total / args.steps * 1e3, total / args.steps * 1e3 / step_ms])
    print_table(["component", "ms per step", "share of step"], rows)
    print(
        "\nModelRunner.execute includes prepare_inputs, the sampling batch (PersistentSamplingRows.build;"
        " SamplingBatch.build only with penalties) and Sampler.__call__.\n"
    )
    print("Input building on one decode plan of the same batch:")
    print_table(["builder", "ms per step", "speedup vs baseline"], compare_input_builders(engine))
    print("\nSampling parameters of the same batch:")
    print_table(["builder", "ms per step", "speedup vs baseline"], compare_sampling_batches(engine))


if __name__ == "__main__":
    main()
