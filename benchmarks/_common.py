"""Helpers the benchmark scripts share: hardware banner, tables, percentiles, a random-weight Llama.

Benchmarks never import from `tests/`; what they need of a checkpoint writer lives here.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, or platform's guess elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware_lines() -> list[str]:
    """What the figures were measured on: CPU, cores, Python, torch and its thread count."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return [
        f"cpu: {cpu_model()} ({os.cpu_count()} logical cores, {usable} usable)",
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}, {platform.system()} {platform.release()}",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (the machine is shared)",
    ]


def print_header(title: str, argv: Sequence[str] | None = None) -> None:
    """Title, exact command line and hardware, so a pasted result says how it was produced."""
    print(f"== {title}")
    print("command: python " + " ".join(argv if argv is not None else sys.argv))
    for line in hardware_lines():
        print(line)
    print()


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table (Markdown-compatible pipes), floats to 3 significant places."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
    print()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the random-weight Llama the model benchmarks run."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    seed: int = 0


# Ids 0..2 are special; benchmark prompts are drawn from ids >= FIRST_PLAIN_ID.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_PLAIN_ID = 3


def build_random_llama(folder: Path, spec: TinyLlamaSpec) -> Any:
    """Write a random-weight Llama checkpoint (save_pretrained) and a word-level tokenizer to `folder`.

    Returns the in-memory transformers model, whose weights are exactly the ones written.
    """
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = transformers.LlamaForCausalLM(config)  # float32: torch's default dtype
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_level_tokenizer(folder, spec.vocab_size)
    return model


def write_word_level_tokenizer(folder: Path, vocab_size: int) -> None:
    """Token i is the word `t<i>`: decoding is trivial and every id in the vocabulary is valid."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"t{i}": i for i in range(FIRST_PLAIN_ID, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )


def fake_request(
    rng: Any, request_id: str, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int
) -> Any:
    """A Request with a random prompt and a random output length, EOS ignored (no model needed)."""
    from kvasir.runtime.core.request import Request
    from kvasir.runtime.sample.params import SamplingParams

    prompt = [rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(rng.randint(*prompt_range))]
    max_tokens = rng.randint(*output_range)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, max_tokens=max_tokens, seed=0, eos_token_ids=(EOS_ID,))


def fake_sampled_tokens(plan: Any, rng: Any, vocab_size: int) -> dict[str, list[int]]:
    """What a model would return for a SchedulerOutput: one random token per request that samples."""
    return {
        item.request.request_id: [rng.randrange(FIRST_PLAIN_ID, vocab_size)]
        for item in plan.scheduled
        if item.sample
    }
