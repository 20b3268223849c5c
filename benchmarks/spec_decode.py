"""Speculative decoding on this CPU: tokens/s with and without each method, and acceptance.

Two workloads on the embedded SmolLM2-135M-Instruct, greedy, chat template applied:
- repetitive: the answer copies much of the prompt (rewrite code with one change, extract
  fields from a record), where prompt lookup shines;
- chat: plain questions, where drafts are mostly rejected and speculation must turn itself down.

`draft_model` drafts with the embedded model's first 12 layers written out as a GGUF file of its
own (`_truncated_gguf.py`): a smaller model sharing the tokenizer, as no trained draft can be
downloaded here. `layer_skip` drafts with the same 12 layers inside the target.

Each configuration runs the same prompts at batch 1 (one request at a time) and batch 8 (eight at
once); the plain engine is measured in the same run, alternating with the speculative one, and
results are ratios against it (the machine is shared and noisy).

    python benchmarks/spec_decode.py                # everything (several minutes on 2 cores)
    python benchmarks/spec_decode.py --quick        # fewer prompts and tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _truncated_gguf import write_truncated_gguf

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.spec_decode.config import SpeculativeConfig, parse_speculative_config

CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
"""
RECORD = (
    "Name: Ada Lovelace; Born: 10 December 1815, London; Died: 27 November 1852, Marylebone; "
    "Known for: the first published algorithm, notes on the Analytical Engine; Father: Lord Byron"
)
REPETITIVE = [
    f"Rewrite this function with the parameter `values` renamed to `samples`. Output only the code.\n\n{CODE}",
    f"Copy this record exactly, one field per line.\n\n{RECORD}",
    f"Add a docstring to this function and output the whole function.\n\n{CODE}",
    "Repeat the following paragraph word for word: The committee met on Tuesday to review the "
    "budget. The committee agreed that the budget for the library should grow, and that the "
    "budget for the stadium should shrink. The committee will meet again on Friday.",
    f"Output this code unchanged, then say 'done'.\n\n{CODE}",
    f"Extract the birth and death fields from this record, quoting them exactly.\n\n{RECORD}",
    f"Rename the function to `rolling_mean` and output the code.\n\n{CODE}",
    f"Repeat this record twice.\n\n{RECORD}",
]
CHAT = [
    "What is the capital of France, and why is it famous?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is to a ten-year-old.",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle and explain it.",
    "What should I pack for a weekend hiking trip?",
    "Describe the taste of an orange.",
]

METHODS = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    "layer_skip": '{"method": "layer_skip", "num_layers": 12, "num_speculative_tokens": 3}',
    "draft_model": '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3}',
}
DRAFT_LAYERS = 12


def speculative_config(method: str, workdir: Path) -> SpeculativeConfig:
    """The method's config; for draft_model, the truncated draft is written to `workdir` first."""
    config = json.loads(METHODS[method])
    if method == "draft_model":
        draft = write_truncated_gguf(embedded_model_path(), workdir / "draft.gguf", DRAFT_LAYERS)
        config["model"] = str(draft)
    return parse_speculative_config(json.dumps(config))


def build(spec: SpeculativeConfig | None, max_num_seqs: int) -> LLMEngine:
    config = EngineConfig(
        model=str(embedded_model_path()),
        served_model_name="SmolLM2-135M-Instruct",
        device="cpu",
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        speculative_config=spec,
    )
    return LLMEngine(config)


def chat_prompts(engine: LLMEngine, texts: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]


def run(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[int, float]:
    """Generated tokens and seconds for the prompts, `batch` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, started = 0, time.perf_counter()
    for first in range(0, len(prompts), batch):
        results = engine.generate(prompts[first : first + batch], params)
        tokens += sum(len(r.choices[0].token_ids) for r in results)
    return tokens, time.perf_counter() - started


@dataclass
class Comparison:
    base_rate: float  # tokens/s without speculation
    spec_rate: float  # tokens/s with it
    drafts: int  # verified runs
    drafted: int
    acceptance: float
    per_position: list[float]  # accepted at position i / verified runs


def compare(
    baseline: LLMEngine, engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int, rounds: int
) -> Comparison:
    """`rounds` alternating runs of the plain and the speculative engine over the same prompts."""
    base_tokens = spec_tokens = 0
    base_time = spec_time = 0.0
    before = engine.drafts.stats.snapshot()
    for _ in range(rounds):
        tokens, seconds = run(baseline, prompts, batch, max_tokens)
        base_tokens, base_time = base_tokens + tokens, base_time + seconds
        tokens, seconds = run(engine, prompts, batch, max_tokens)
        spec_tokens, spec_time = spec_tokens + tokens, spec_time + seconds
    after = engine.drafts.stats
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    earlier = before.accepted_per_position
    per_position = [
        (count - (earlier[i] if i < len(earlier) else 0)) / max(drafts, 1)
        for i, count in enumerate(after.accepted_per_position)
    ]
    return Comparison(
        base_tokens / base_time,
        spec_tokens / spec_time,
        drafts,
        drafted,
        accepted / max(drafted, 1),
        per_position,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens, one round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating baseline/speculative rounds")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    args = parser.parse_args()
    print_header("Speculative decoding on the embedded model (greedy)")
    num_prompts = 4 if args.quick else 8
    max_tokens = 64 if args.quick else args.max_tokens
    rounds = 1 if args.quick else args.rounds

    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    # Draft files are written once, before any engine is built, and removed at the end.
    with tempfile.TemporaryDirectory(prefix="kvasir-spec-bench-") as workdir:
        specs = {method: speculative_config(method, Path(workdir)) for method in methods}
        rows = []
        acceptance_rows = []
        for batch in (1, 8):
            baseline = build(None, batch)
            workloads = {
                "repetitive": chat_prompts(baseline, REPETITIVE[:num_prompts]),
                "chat": chat_prompts(baseline, CHAT[:num_prompts]),
            }
            baseline.generate(workloads["chat"][:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
            for method in methods:
                engine = build(specs[method], batch)
                for workload, prompts in workloads.items():
                    m = compare(baseline, engine, prompts, batch, max_tokens, rounds)
                    rows.append(
                        [method, workload, batch, round(m.base_rate, 1), round(m.spec_rate, 1),
                         round(m.spec_rate / m.base_rate, 2), round(m.acceptance, 2) if m.drafted else "-"]
                    )  # fmt: skip
                    per_position = " ".join(f"{rate:.2f}" for rate in m.per_position) or "-"
                    acceptance_rows.append([method, workload, batch, m.drafts, per_position])
                    print(
                        f"  {method:10} {workload:10} batch {batch}: {m.spec_rate / m.base_rate:.2f}x",
                        flush=True,
                    )
    print()
    print_table(["method", "workload", "batch", "plain tok/s", "spec tok/s", "speed-up", "acceptance"], rows)
    print()
    print("Acceptance rate per draft position (accepted / verified runs):")
    print_table(["method", "workload", "batch", "runs", "per position"], acceptance_rows)


if __name__ == "__main__":
    main()
