"""Prefix caching: many requests sharing a long system prompt, with and without the prefix cache.

`--num-requests` requests arrive together, each a shared `--system-tokens` system prompt plus a
short distinct user suffix. Reported per mode: prompt tokens actually computed (prompt tokens minus
those served from the cache), time to first token from the request timestamps
(`first_token - arrival`: mean, p50, p99; queueing included, as a client sees it) and the total
time. Both modes run the same random-weight Llama in one process, one after the other.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    FIRST_PLAIN_ID,
    TinyLlamaSpec,
    build_random_llama,
    mean,
    percentile,
    print_header,
    print_table,
)


@dataclass(frozen=True)
class ModeResult:
    prefix_caching: bool
    prompt_tokens: int
    cached_tokens: int
    ttft_s: list[float]
    total_s: float
    token_ids: dict[str, list[int]]  # each request's output, to check both modes agree

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(args.system_tokens)]
    prompts = []
    for _ in range(args.num_requests):
        suffix_len = rng.randint(args.min_suffix, args.max_suffix)
        prompts.append(system + [rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(suffix_len)])
    return prompts


def run_mode(
    folder: Path, prompts: list[list[int]], args: argparse.Namespace, prefix_caching: bool
) -> ModeResult:
    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.engine.outputs import RequestTimes, record_times
    from kvasir.runtime.sample.params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="float32",
            max_model_len=args.system_tokens + args.max_suffix + args.output_tokens,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=prefix_caching,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    # Warm-up on a prompt that shares nothing with the measured ones (ids below FIRST_PLAIN_ID+1).
    engine.generate([[FIRST_PLAIN_ID] * 40], params)
    engine.kv_cache.reset_prefix_cache()

    ttft: list[float] = []
    token_ids: dict[str, list[int]] = {}
    times: dict[str, RequestTimes] = {}
    cached = 0
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        prepared = engine.prepare_request(f"r{index}", params=params, prompt_token_ids=prompt)
        engine.add_prepared(prepared)
        times[prepared.request_id] = RequestTimes(arrival=prepared.arrival_time)
    while engine.has_unfinished():
        for output in engine.step():
            for choice in output.outputs:
                token_ids.setdefault(output.request_id, []).extend(choice.token_ids)
                record_times(times[output.request_id], choice)
            if not output.finished:
                continue
            cached += output.num_cached_tokens
            record = times[output.request_id]
            if record.first_token is None:
                raise RuntimeError(f"{output.request_id} finished without a token")
            ttft.append(record.first_token - record.arrival)
    total = time.perf_counter() - started
    return ModeResult(prefix_caching, sum(len(p) for p in prompts), cached, ttft, total, token_ids)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--min-suffix", type=int, default=8)
    parser.add_argument("--max-suffix", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine two OpenMP threads stall on each other)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print_header("prefix caching: shared system prompt")
    spec = TinyLlamaSpec(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(2048, args.system_tokens + args.max_suffix + args.output_tokens),
        seed=args.seed,
    )
    prompts = make_prompts(args, spec.vocab_size)
    print(
        f"model: random Llama, hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads / "
        f"{spec.num_kv_heads} KV heads, vocab {spec.vocab_size}, float32"
    )
    print(
        f"workload: {args.num_requests} requests at once, {args.system_tokens}-token shared system prompt + "
        f"{args.min_suffix}-{args.max_suffix}-token suffix, {args.output_tokens} output tokens each; "
        f"max_num_batched_tokens {args.max_num_batched_tokens}, block size {args.block_size}\n"
    )
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-") as tmp:
        folder = Path(tmp) / "model"
        build_random_llama(folder, spec)  # the transformers model it returns is not needed here
        results = [run_mode(folder, prompts, args, prefix_caching) for prefix_caching in (False, True)]
    rows = []
    for result in results:
        rows.append(
            [
                "on" if result.prefix_caching else "off",
                result.prompt_tokens,
                result.computed_tokens,
                result.cached_tokens / result.prompt_tokens,
                mean(result.ttft_s),
                percentile(result.ttft_s, 50),
                percentile(result.ttft_s, 99),
                result.total_s,
            ]
        )
    print_table(
        [
            "prefix caching",
            "prompt tokens",
            "prompt tokens computed",
            "hit rate",
            "TTFT mean s",
            "TTFT p50 s",
            "TTFT p99 s",
            "total s",
        ],
        rows,
    )
    off, on = results
    same = off.token_ids == on.token_ids
    print(f"greedy outputs identical with and without prefix caching: {'yes' if same else 'NO'}\n")
    print_table(
        ["computed tokens off/on", "TTFT mean off/on", "TTFT p50 off/on", "TTFT p99 off/on", "total off/on"],
        [
            [
                off.computed_tokens / on.computed_tokens,
                mean(off.ttft_s) / mean(on.ttft_s),
                percentile(off.ttft_s, 50) / percentile(on.ttft_s, 50),
                percentile(off.ttft_s, 99) / percentile(on.ttft_s, 99),
                off.total_s / on.total_s,
            ]
        ],
    )


if __name__ == "__main__":
    main()
