"""Where a CPU decode step of a GGUF model goes: embedding lookup, decoder layers, LM head and the
rest (inputs, sampler), per batch size, for any GGUF file (default: the embedded SmolLM2).

    python benchmarks/gguf_step_breakdown.py                           # batch 1, 8 and 32
    python benchmarks/gguf_step_breakdown.py --model qwen-0.5b-q4_k_m.gguf --threads 2 --rounds 3

One `LLMEngine` with its defaults (the C decoder stack where it binds). A round generates
`--tokens` greedy tokens (EOS ignored) for `batch` requests of a `--prompt`-token prompt; a decode
step is one `ModelRunner.execute`, and the model's embedding, decoder forward and
`compute_logits` are timed inside it. Times are the process's CPU time (`time.process_time`;
with more than one thread, the threads' sum), medians over every decode step of every round after
a warm-up round. The LM head's row also gives its bytes and the bandwidth its median implies: on
a large vocabulary (150k tokens) it is the biggest single matrix of the step; the decoder layers'
row does the same with every layer's weights. Both are set against the memory-bandwidth floor: the
bytes read at the rate one thread streams a 256 MiB float32 tensor (`torch.sum`, best of ten),
which a step whose weights come from memory cannot beat. The startup log line of the weights
(which kernel runs each layer, what went to float32) is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import print_header, print_table

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample.params import SamplingParams

PARTS = ("embedding", "decoder layers", "LM head")


class StepParts:
    """Wraps the runner's `execute` and three parts of the model: CPU seconds per step and part."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        runner = engine.runner
        model = runner.model
        embed = model.model.embed_tokens  # type: ignore[union-attr]
        inner = model.model  # type: ignore[union-attr]
        embed.forward = self._timed("embedding", embed.forward)  # type: ignore[method-assign]
        inner.forward = self._timed("decoder layers", inner.forward)  # type: ignore[method-assign]
        model.compute_logits = self._timed("LM head", model.compute_logits)  # type: ignore[method-assign]
        real_execute = runner.execute

        def execute(plan: Any) -> Any:
            self._current = dict.fromkeys(PARTS, 0.0)
            started = time.process_time()
            result = real_execute(plan)
            self._current["step"] = time.process_time() - started
            self.steps.append(self._current)
            return result

        runner.execute = execute  # type: ignore[method-assign]

    def _timed(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return call(*args, **kwargs)
            finally:
                self._current[part] = self._current.get(part, 0.0) + time.process_time() - started

        return timed

    def medians(self) -> dict[str, float]:
        """Median ms per part; "decoder layers" excludes the embedding it calls, "rest" is the
        step less the three parts."""
        rows = []
        for step in self.steps:
            layers = step["decoder layers"] - step["embedding"]
            rest = step["step"] - step["decoder layers"] - step["LM head"]
            rows.append({**step, "decoder layers": layers, "rest": rest})
        return {key: statistics.median(row[key] for row in rows) * 1e3 for key in (*PARTS, "rest", "step")}


def stream_bandwidth() -> float:
    """Bytes per second one thread reads a 256 MiB float32 tensor at (`torch.sum`, best of ten)."""
    data = torch.ones(1 << 26)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    torch.set_num_threads(threads)
    return data.numel() * data.element_size() / best


def module_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def run_round(engine: LLMEngine, parts: StepParts, batch: int, args: argparse.Namespace) -> None:
    prompts = [[(7 * r + i) % 1000 + 10 for i in range(args.prompt)] for r in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    first = len(parts.steps)
    engine.generate(prompts, params)
    del parts.steps[first]  # the prefill step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_header("GGUF CPU decode step by part: embedding, decoder layers, LM head, rest", sys.argv)
    model = args.model or str(embedded_model_path())
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cpu",
            max_model_len=args.prompt + args.tokens + 16,
            max_num_seqs=max(args.batches),
        )
    )
    report = engine.runner.weights_report
    print(f"weights: {report.summary()}")
    head_bytes = module_bytes(engine.runner.model.lm_head)
    layers_bytes = module_bytes(engine.runner.model.model.layers)  # type: ignore[union-attr]
    bandwidth = stream_bandwidth()
    print(f"one thread streams {bandwidth / 1e9:.1f} GB/s (torch.sum of 256 MiB float32, best of 10)")
    read = {"LM head": head_bytes, "decoder layers": layers_bytes}
    rows = []
    for batch in args.batches:
        parts = StepParts(engine)
        run_round(engine, parts, batch, args)  # warm-up
        parts.steps.clear()
        for _ in range(args.rounds):
            run_round(engine, parts, batch, args)
        medians = parts.medians()
        step = medians["step"]
        for part in (*PARTS, "rest"):
            share = f"{100 * medians[part] / step:.1f}%"
            note = ""
            if part in read and medians[part] > 0:
                floor = read[part] / bandwidth * 1e3
                note = (
                    f"{read[part] / 2**20:.1f} MiB read, {read[part] / medians[part] / 1e6:.1f} GB/s; "
                    f"floor {floor:.1f} ms ({medians[part] / floor:.2f}x it)"
                )
            rows.append([batch, part, medians[part], share, note])
        rows.append([batch, "step", step, "100%", f"{len(parts.steps)} steps"])
    print_table(["batch", "part", "CPU ms (median)", "share", "note"], rows)


if __name__ == "__main__":
    main()
