"""Structured output on this CPU: what a grammar costs the embedded model (SmolLM2-135M-Instruct,
49,152-token vocabulary), one torch thread, in four parts.

1. The token mask per sequence per step: `GrammarState.fill_bitmask` replayed along the tokens of
   real constrained generations (this engine, greedy) for a 10-field JSON schema, the 50-tool
   `required` calls schema, any JSON object, a regex, a choice and a Lark grammar; p50/p99/max in
   us of wall and of thread CPU time (a preempted fill's wall time is the OS's, not the grammar's),
   the first pass over a freshly compiled grammar apart (goal: p50 <= 100 us, p99 <= 1 ms). And
   `apply_token_bitmask` on [8, 49152] float32 logits.
2. Time per output token at batch 8, the 10-field schema against no grammar: same prompts, same
   engine, alternating rounds; the unconstrained side ignores EOS and both stop at --max-tokens,
   so decode steps are compared per token at the same batch and context, on the wall and process
   CPU clocks (goal: <= 1.10x). Then one instrumented run of each says where a step's time
   goes.
3. Compile: the `required` tool_choice shape over 50 tools (a JSON array of `{"name": {"const"},
   "arguments": <5-field schema>}` anyOf the tools) with a fresh `GrammarCompiler` (llguidance's
   tokenizer build apart; goal < 2 s), and what the cached grammar adds to a second request's
   `prepare_request` and TTFT (goal < 5 ms).
4. Schemas sent while 4 streams decode (512 tokens each, no grammar), through `kvasir serve`
   (streamed chat completions, the schema in `structured_outputs`): the server's first grammar
   (llguidance's tokenizer is built then), then pathological ones - an anyOf/allOf nest of depth 16
   through $defs (3.9 KB), inline anyOf nests of depth 16 (7.2 MB) and 11 (225 KB), an anyOf of
   16,000 empty schemas (48 KB). Each is answered within about the compile deadline; the streams'
   inter-token latency p99 against the same streams without it, run just before (goal <= 1.5x),
   over the whole streams and over the seconds the compile worked. `--level engine`: the same at
   the engine level (`AsyncEngine` streams, `prepare_request` on a thread of its own), where no
   body bounds apply (an inline nest of depth 12, 450 KB, and 60,000 empty schemas instead).

    python benchmarks/structured_outputs.py                 # all four parts (~20 min on 2 cores)
    python benchmarks/structured_outputs.py --parts 1,3     # some of them
    python benchmarks/structured_outputs.py --quick         # fewer tokens and rounds
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llguidance
import numpy as np
import torch
from _common import percentile, print_header, print_table

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample import sampler as sampler_module
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.structured.compiler import CompiledGrammar, GrammarCompiler
from kvasir.runtime.structured.grammar_text import json_options
from kvasir.runtime.structured.limits import GrammarLimits
from kvasir.runtime.structured.matcher import GrammarState, bitmask_words
from kvasir.runtime.structured.params import StructuredOutputs, canonical_json, parse_structured_outputs
from kvasir.runtime.structured.schema_check import check_schema
from kvasir.runtime.worker import grammar_masks as grammar_masks_module
from kvasir.runtime.worker.grammar_masks import additive_mask

SEED = 0
BATCH = 8

# ---- grammars -----------------------------------------------------------------------------

# Ten fields of mixed types: strings (free, bounded, email, date, pattern), integer with a range,
# number, boolean, enum, an array and a nested object.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "height_m": {"type": "number"},
        "is_member": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "joined": {"type": "string", "format": "date"},
        "bio": {"type": "string"},
    },
    "additionalProperties": False,
}
PERSON_SCHEMA["required"] = list(PERSON_SCHEMA["properties"])
PERSON_PROMPTS = [
    "Invent a fictional librarian and describe them as a JSON record.",
    "Describe a made-up astronaut as JSON: name, age, contact details and a short biography.",
    "Create a JSON profile for an imaginary chef who lives in Lyon.",
    "Write a JSON record for a fictional student who joined a chess club in 2021.",
    "Give me a JSON user record for a retired teacher who loves gardening.",
    "Make up a JSON profile of a software engineer from Nairobi.",
    "Produce a JSON description of a fictional marathon runner.",
    "Describe an invented museum curator as a JSON object.",
]

_VERBS = ["get", "search", "create", "update", "delete", "list", "book", "cancel", "send", "convert"]
_NOUNS = ["weather", "flight", "hotel", "invoice", "order"]
_FIELDS = [
    "city", "date", "count", "query", "currency", "amount", "email", "priority", "limit", "notes",
    "country", "user_id", "start", "end", "language", "status", "category", "price", "rating", "tag",
    "timezone", "channel", "quantity", "reason", "format",
]  # fmt: skip


def tool_arguments(index: int) -> dict[str, Any]:
    """A 5-field parameters schema, different for each tool (names rotate, types cycle)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["low", "medium", "high"]},
    ]
    names = [_FIELDS[(index * 3 + k) % len(_FIELDS)] for k in range(5)]
    properties = {name: kinds[(index + k) % 5] for k, name in enumerate(names)}
    return {"type": "object", "properties": properties, "required": names[:3], "additionalProperties": False}


def tool_names(count: int) -> list[str]:
    return [f"{_VERBS[i % len(_VERBS)]}_{_NOUNS[i // len(_VERBS) % len(_NOUNS)]}_{i}" for i in range(count)]


def tools_schema(count: int) -> dict[str, Any]:
    """tool_choice "required" over `count` tools: the shape the server builds (one call, or more)."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": tool_arguments(i)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, name in enumerate(tool_names(count))
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}


TOOL_PROMPTS = [
    "Use a tool to get the weather for Paris tomorrow.",
    "Book a hotel in Rome for two nights with a tool call.",
    "Search for flights from Oslo to Madrid using the tools.",
    "Send an invoice of 120 euros with the right tool.",
    "Cancel my order number 42 with a tool.",
    "List the hotels in Berlin, high priority, using a tool.",
    "Convert 300 dollars to yen with a tool call.",
    "Create an order for three chairs using the tools.",
]
REGEX = r"name,age\n([A-Z][a-z]{1,12},[0-9]{1,2}\n){3,8}"
REGEX_PROMPTS = [
    "Write a CSV with a header name,age and five people.",
    "List four children and their ages as CSV (name,age).",
    "Give me a CSV of six football players and their ages.",
    "CSV of three grandparents with their ages, header name,age.",
    "Write a name,age CSV of the members of a band.",
    "Make a CSV (name,age) of seven invented cousins.",
    "A CSV table with name and age of five teachers.",
    "CSV, header name,age: four neighbours.",
]
CHOICES = ["positive", "negative", "neutral", "mixed"]
CHOICE_PROMPTS = [
    "Sentiment of: 'I loved the film, the ending was perfect.'",
    "Sentiment of: 'The food was cold and the waiter was rude.'",
    "Sentiment of: 'The meeting is at three.'",
    "Sentiment of: 'Great screen, terrible battery.'",
    "Sentiment of: 'What a wonderful day at the beach!'",
    "Sentiment of: 'I will never buy from them again.'",
    "Sentiment of: 'The package arrived on Tuesday.'",
    "Sentiment of: 'Nice hotel, but the noise kept us awake.'",
]
LARK = r"""
start: "SELECT " cols " FROM " NAME where? ";"
cols: "*" | NAME (", " NAME)*
where: " WHERE " cond (" AND " cond)*
cond: NAME " " OP " " VALUE
OP: "=" | "<" | ">" | "<=" | ">="
VALUE: /[0-9]+/ | /'[A-Za-z ]{0,20}'/
NAME: /[a-z_]{1,20}/
"""
SQL_PROMPTS = [
    "SQL: the names of users older than 30.",
    "SQL: every column of the orders table.",
    "SQL: titles and years of books published after 1990.",
    "SQL: emails of customers in the city 'Paris'.",
    "SQL: ids of products whose price is below 20.",
    "SQL: the name and salary of employees in department 4.",
    "SQL: all flights from 'Oslo'.",
    "SQL: city and population of cities larger than 1000000.",
]
JSON_OBJECT_PROMPTS = [
    "Describe your favourite book as a JSON object.",
    "Return a JSON object with a recipe for pancakes.",
    "A JSON object describing a car.",
    "Give the weather forecast for tomorrow as JSON.",
    "A JSON object with three facts about the moon.",
    "Describe a cat as a JSON object.",
    "A JSON object listing a shopping list.",
    "Describe a city you like as JSON.",
]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    spec: StructuredOutputs
    prompts: list[str]


def workloads(tools: int) -> list[Workload]:
    return [
        Workload("json_schema, 10 fields", parse_structured_outputs({"json": PERSON_SCHEMA}), PERSON_PROMPTS),
        Workload(f"json_schema, {tools} tools", parse_structured_outputs({"json": tools_schema(tools)}), TOOL_PROMPTS),
        Workload("json_object", parse_structured_outputs({"json_object": True}), JSON_OBJECT_PROMPTS),
        Workload("regex (CSV rows)", parse_structured_outputs({"regex": REGEX}), REGEX_PROMPTS),
        Workload("choice (4)", parse_structured_outputs({"choice": CHOICES}), CHOICE_PROMPTS),
        Workload("grammar (Lark SQL)", parse_structured_outputs({"grammar": LARK}), SQL_PROMPTS),
    ]  # fmt: skip


# ---- engine helpers -----------------------------------------------------------------------


def build_engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(embedded_model_path()),
            served_model_name="SmolLM2-135M-Instruct",
            device="cpu",
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=BATCH,
        )
    )


def chat(engine: LLMEngine, texts: Sequence[str]) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]


def fresh_compiler(engine: LLMEngine, limits: GrammarLimits | None = None) -> GrammarCompiler:
    """A compiler like the engine's, with nothing built yet (no tokenizer, empty cache)."""
    return GrammarCompiler(
        engine.tokenizer.backend.to_str,
        engine.model_config.vocab_size,
        engine.tokenizer.eos_token_ids or engine.model_config.eos_token_ids,
        limits or engine.config.grammar_limits,
    )


def us(seconds: float) -> float:
    return seconds * 1e6


def ms(seconds: float) -> float:
    return seconds * 1e3


# ---- part 1: the mask ---------------------------------------------------------------------


@dataclasses.dataclass
class Replay:
    wall: list[float]  # seconds per fill, every pass
    cpu: list[float]  # the same fills' thread CPU time (what a preempted thread's wall time hides)
    first_cpu: list[float]  # the first pass over a freshly compiled grammar
    per_step_8: list[float]  # CPU seconds of the 8 sequences' fills at one output position, summed
    tokens: int
    refused: int  # generated tokens the replayed mask did not allow (must be 0)


def replay(compiled_fresh: CompiledGrammar, outputs: list[list[int]], words: int, passes: int) -> Replay:
    """Fill each sequence's mask at every position of its generated tokens, accepting them in turn
    as the scheduler does (stopping where the grammar ends the sequence)."""
    bitmask = np.full((1, words), -1, dtype=np.int32)
    result = Replay([], [], [], [], sum(len(t) for t in outputs), 0)
    position_sums: dict[int, float] = {}
    for pass_index in range(passes):
        for tokens in outputs:
            state: GrammarState = compiled_fresh.new_state()
            for position, token in enumerate(tokens):
                started, started_cpu = time.perf_counter(), time.thread_time()
                state.fill_bitmask(bitmask, 0)
                cpu = time.thread_time() - started_cpu
                result.wall.append(time.perf_counter() - started)
                result.cpu.append(cpu)
                if pass_index == 0:
                    result.first_cpu.append(cpu)
                position_sums[position] = position_sums.get(position, 0.0) + cpu / passes
                if not (int(bitmask[0, token >> 5]) >> (token & 31)) & 1:
                    result.refused += 1
                state.accept(token)
                if state.terminated:
                    break
    result.per_step_8 = [
        total for position, total in position_sums.items() if all(len(t) > position for t in outputs)
    ]
    return result


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [result.choices[0].token_ids for result in engine.generate(prompts, params)]


def part_mask(engine: LLMEngine, args: argparse.Namespace) -> None:
    print("## 1. Token mask per sequence per step (fill_bitmask along real constrained outputs)\n")
    words = bitmask_words(engine.model_config.vocab_size)
    rows = []
    samples: dict[str, list[list[int]]] = {}
    for workload in workloads(args.tools):
        prompts = chat(engine, workload.prompts)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.mask_tokens, structured_outputs=workload.spec
        )
        outputs = generate(engine, prompts, params)
        samples[workload.name] = outputs
        compiled = fresh_compiler(engine).compile(workload.spec)  # its own matcher caches: a cold first pass
        r = replay(compiled, outputs, words, args.replays + 1)
        rows.append(
            [workload.name, r.tokens, round(us(percentile(r.wall, 50)), 1), round(us(percentile(r.wall, 99)), 1),
             round(us(max(r.wall)), 1), round(us(percentile(r.cpu, 50)), 1), round(us(percentile(r.cpu, 99)), 1),
             round(us(max(r.cpu)), 1), round(us(percentile(r.first_cpu, 99)), 1),
             round(us(statistics.fmean(r.per_step_8)), 1) if r.per_step_8 else "-", r.refused]
        )  # fmt: skip
        print(
            f"  {workload.name}: {r.tokens} tokens, e.g. {engine.tokenizer.decode(outputs[0])[:90]!r}",
            flush=True,
        )
    print()
    print_table(
        ["grammar", "tokens", "wall p50 us", "wall p99 us", "wall max us", "CPU p50 us", "CPU p99 us",
         "CPU max us", "first pass CPU p99", "8 seqs per step CPU us", "tokens refused"],
        rows,
    )  # fmt: skip
    print(
        f"Every fill of {args.replays + 1} passes over the outputs (each sequence a fresh copy of the\n"
        "compiled grammar); first pass: the first walk after compiling (a fresh compiler), lexer states\n"
        "built on the way. CPU: the thread's CPU time, which leaves out the time the OS ran something\n"
        "else (on this shared machine a preempted fill reads ~4 ms of wall time). '8 seqs per step':\n"
        "one step's fills for the 8 sequences, summed, at positions all 8 reached.\n"
        "Goal: p50 <= 100 us, p99 <= 1 ms.\n"
    )

    # apply_token_bitmask on [8, V]: masks of 8 real states (the 10-field schema, mid-output).
    person = workloads(args.tools)[0]
    compiled = engine.grammars.compile(person.spec)
    bitmask = np.full((BATCH, words), -1, dtype=np.int32)
    for row, tokens in enumerate(samples[person.name]):
        state = compiled.new_state()
        for token in tokens[: 5 + 7 * row]:  # different positions: keys, strings, numbers
            state.accept(token)
        state.fill_bitmask(bitmask, row)
    generator = torch.Generator().manual_seed(SEED)
    logits = torch.randn(BATCH, engine.model_config.vocab_size, generator=generator)
    cases = {
        "8 of 8 rows constrained": torch.from_numpy(bitmask.copy()),
        "4 of 8 rows constrained": torch.from_numpy(np.where(np.arange(BATCH)[:, None] < 4, bitmask, -1)),
        "no row constrained (all ones)": torch.full((BATCH, words), -1, dtype=torch.int32),
    }
    apply_rows = []
    for name, tensor in cases.items():
        apply_rows.append(
            [name, *timed_call(lambda t=tensor: sampler_module.apply_token_bitmask(logits, t), args)]
        )
    full = cases["8 of 8 rows constrained"]
    vocab = engine.model_config.vocab_size
    additive = torch.from_numpy(additive_mask(full.numpy(), vocab))
    assert torch.equal(
        sampler_module.apply_token_bitmask(logits, additive), sampler_module.apply_token_bitmask(logits, full)
    )
    apply_rows.append(
        ["8 of 8, unpacked to an additive mask (the CPU path: the sampler's share)",
         *timed_call(lambda: sampler_module.apply_token_bitmask(logits, additive), args)]
    )  # fmt: skip
    apply_rows.append(
        ["8 of 8: building that additive mask (the CPU path: the helper thread's share)",
         *timed_call(lambda: additive_mask(full.numpy(), vocab), args)]
    )  # fmt: skip
    apply_rows.append(
        ["(for scale: argmax of the same logits)", *timed_call(lambda: logits.argmax(dim=-1), args)]
    )
    print(f"apply_token_bitmask on [{BATCH}, {engine.model_config.vocab_size}] float32 logits:\n")
    print_table(["bitmask", "wall p50 us", "wall p99 us", "CPU p50 us", "CPU p99 us"], apply_rows)


def timed_call(call: Callable[[], Any], args: argparse.Namespace) -> list[float]:
    """Wall and thread-CPU p50/p99 of `call`, in us."""
    wall, cpu = [], []
    for _ in range(args.apply_iters):
        started, started_cpu = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started)
    return [round(us(percentile(wall, 50)), 1), round(us(percentile(wall, 99)), 1),
            round(us(percentile(cpu, 50)), 1), round(us(percentile(cpu, 99)), 1)]  # fmt: skip


# ---- part 2: time per output token at batch 8 ----------------------------------------------


@dataclasses.dataclass
class BatchRun:
    full_steps: list[float]  # wall seconds of decode steps with all 8 sequences
    full_cpu: list[float]  # the same steps' process CPU seconds (every thread: the mask's too)
    decode_time: float  # all decode steps (any batch), seconds
    decode_tokens: int
    tokens: int
    wall: float


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> BatchRun:
    """The prompts at once through engine.step(), each step timed and classified by what it ran."""
    shapes: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recording(plan: Any) -> Any:
        result = execute(plan)
        shapes.append((result.num_tokens, len(result.request_ids)))
        return result

    engine.runner.execute = recording  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            engine.add_prepared(
                engine.prepare_request(f"{tag}-{index}", None, params, prompt_token_ids=prompt)
            )
        full, full_cpu, decode_time, decode_tokens, tokens = [], [], 0.0, 0, 0
        while engine.has_unfinished():
            before = len(shapes)
            step_started, cpu_started = time.perf_counter(), time.process_time()
            outputs = engine.step()
            elapsed = time.perf_counter() - step_started
            cpu = time.process_time() - cpu_started
            tokens += sum(len(delta.token_ids) for output in outputs for delta in output.outputs)
            if len(shapes) == before + 1:
                num_tokens, num_sampled = shapes[-1]
                if num_tokens == num_sampled:  # a pure decode step
                    decode_time += elapsed
                    decode_tokens += num_sampled
                    if num_sampled == len(prompts):
                        full.append(elapsed)
                        full_cpu.append(cpu)
        return BatchRun(full, full_cpu, decode_time, decode_tokens, tokens, time.perf_counter() - started)
    finally:
        del engine.runner.execute


@dataclasses.dataclass
class Breakdown:
    """Seconds per full-batch decode step, summed over such steps, by where they went."""

    steps: int = 0
    fill: float = 0.0  # helper thread: the 8 rows' masks
    wait: float = 0.0  # engine thread: blocked in PendingBitmask.tensor()
    apply: float = 0.0  # sampler: apply_token_bitmask
    accept: float = 0.0  # scheduler.update: GrammarState.accept + terminated, 8 sequences
    total: float = 0.0


def instrumented(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> Breakdown:
    """One run with each piece of the grammar's work timed (the timers themselves cost a little)."""
    clock = time.perf_counter
    step_parts: dict[str, float] = {}

    def add(key: str, seconds: float) -> None:
        step_parts[key] = step_parts.get(key, 0.0) + seconds

    masks = engine.runner.grammar_masks
    fill, tensor = masks._fill, grammar_masks_module.PendingBitmask.tensor
    apply, accept = sampler_module.apply_token_bitmask, GrammarState.accept

    def timed_fill(rows: Any) -> Any:
        started = clock()
        try:
            return fill(rows)
        finally:
            add("fill", clock() - started)

    def timed_tensor(self: Any) -> torch.Tensor:
        started = clock()
        try:
            return tensor(self)
        finally:
            add("wait", clock() - started)

    def timed_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        started = clock()
        try:
            return apply(logits, bitmask)
        finally:
            add("apply", clock() - started)

    def timed_accept(self: GrammarState, token_id: int) -> None:
        started = clock()
        try:
            accept(self, token_id)
            self.terminated  # noqa: B018 - the scheduler reads it after each accept
        finally:
            add("accept", clock() - started)

    masks._fill = timed_fill  # type: ignore[method-assign]
    grammar_masks_module.PendingBitmask.tensor = timed_tensor  # type: ignore[method-assign]
    sampler_module.apply_token_bitmask = timed_apply
    GrammarState.accept = timed_accept  # type: ignore[method-assign]
    breakdown = Breakdown()
    try:
        for index, prompt in enumerate(prompts):
            engine.add_prepared(
                engine.prepare_request(f"{tag}-{index}", None, params, prompt_token_ids=prompt)
            )
        while engine.has_unfinished():
            step_parts.clear()
            running = engine.scheduler.num_running
            started = clock()
            engine.step()
            elapsed = clock() - started
            decode = all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running)
            if running == len(prompts) and engine.scheduler.num_running == len(prompts) and decode:
                breakdown.steps += 1
                breakdown.total += elapsed
                breakdown.fill += step_parts.get("fill", 0.0)
                breakdown.wait += step_parts.get("wait", 0.0)
                breakdown.apply += step_parts.get("apply", 0.0)
                breakdown.accept += step_parts.get("accept", 0.0)
    finally:
        del masks._fill
        grammar_masks_module.PendingBitmask.tensor = tensor  # type: ignore[method-assign]
        sampler_module.apply_token_bitmask = apply
        GrammarState.accept = accept  # type: ignore[method-assign]
    return breakdown


PLAIN, CONSTRAINED = "no grammar", "json_schema"


def part_tpot(engine: LLMEngine, args: argparse.Namespace) -> None:
    print(f"## 2. Time per output token at batch {BATCH}: 10-field json_schema vs no grammar\n")
    prompts = chat(engine, PERSON_PROMPTS)
    person = parse_structured_outputs({"json": PERSON_SCHEMA})
    sides = {
        PLAIN: SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
        CONSTRAINED: SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=person),
    }
    for name, params in sides.items():  # warm-up, and the grammar compiled into the engine's cache
        run_batch(engine, prompts, dataclasses.replace(params, max_tokens=8), f"warm-{name}")
    runs: dict[str, list[BatchRun]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):  # every side once a round, the order rotated each round
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(run_batch(engine, prompts, sides[name], f"r{r}-{name}"))
        print(
            f"  round {r + 1}: full-batch step "
            + " / ".join(f"{ms(statistics.fmean(runs[name][-1].full_steps)):.1f}" for name in names)
            + f" ms ({' / '.join(names)})",
            flush=True,
        )
    rows = []
    for name, side in runs.items():
        per_token = [statistics.fmean(run.full_steps) / BATCH for run in side]
        cpu_per_token = [statistics.fmean(run.full_cpu) / BATCH for run in side]
        rows.append(
            [name, statistics.fmean([run.tokens for run in side]), sum(len(run.full_steps) for run in side),
             round(ms(statistics.median(per_token)), 2), round(ms(statistics.median(cpu_per_token)), 2),
             round(ms(statistics.median([run.wall / run.tokens for run in side])), 2)]
        )  # fmt: skip
    print()
    print_table(
        ["side", "tokens per run", "full-batch steps", "ms/token (8 decoding)", "CPU ms/token (8 decoding)",
         "wall ms/token (incl. prefill)"],
        rows,
    )  # fmt: skip
    ratio_rows = []
    for name in (CONSTRAINED,):
        for clock, attribute in (("wall", "full_steps"), ("process CPU", "full_cpu")):
            plain = [statistics.fmean(getattr(run, attribute)) for run in runs[PLAIN]]
            constrained = [statistics.fmean(getattr(run, attribute)) for run in runs[name]]
            ratios = [b / a for a, b in zip(plain, constrained, strict=True)]
            pooled = statistics.fmean(constrained) / statistics.fmean(plain)
            ratio_rows.append(
                [name, clock, round(statistics.median(ratios), 3), f"{min(ratios):.3f} .. {max(ratios):.3f}",
                 round(pooled, 3)]
            )  # fmt: skip
    print("Against no grammar, time per token of the decode steps with all 8 sequences (goal <= 1.10):\n")
    print_table(
        ["side", "clock", "median of the rounds' ratios", "min .. max over rounds", "pooled"], ratio_rows
    )

    print("Where a full-batch step's time goes (one instrumented run each, per step):\n")
    rows = []
    for name in names:
        b = instrumented(engine, prompts, sides[name], f"prof-{name}")
        n = max(b.steps, 1)
        rows.append(
            [name, b.steps, round(ms(b.total / n), 2), round(ms(b.fill / n), 3), round(ms(b.wait / n), 3),
             round(ms(b.apply / n), 3), round(ms(b.accept / n), 3)]
        )  # fmt: skip
    print_table(
        ["side", "steps", "step ms", "mask fill ms (helper thread)", "waiting for mask ms",
         "apply_token_bitmask ms", "accept x8 ms (scheduler)"],
        rows,
    )  # fmt: skip


# ---- part 3: compile ----------------------------------------------------------------------


def part_compile(engine: LLMEngine, args: argparse.Namespace) -> None:
    print(f"## 3. Compile: tool_choice 'required' over {args.tools} tools\n")
    schema = tools_schema(args.tools)
    spec = parse_structured_outputs({"json": schema})
    print(f"  schema: {len(spec.value):,} bytes of JSON\n")
    cold_rows = []
    totals = []
    for attempt in range(args.compile_repeats):
        compiler = fresh_compiler(engine)
        started = time.perf_counter()
        tokenizer = compiler.tokenizer()
        tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        compiler.compile(spec)
        compile_s = time.perf_counter() - started
        compiler.close()
        # The same work again, phase by phase, on the tokenizer already built.
        started = time.perf_counter()
        check_schema(schema, "schema")
        check_s = time.perf_counter() - started
        started = time.perf_counter()
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options(GrammarLimits()))
        grammar_s = time.perf_counter() - started
        started = time.perf_counter()
        llguidance.LLMatcher(tokenizer, text, log_level=0)
        matcher_s = time.perf_counter() - started
        totals.append(compile_s)
        cold_rows.append(
            [attempt + 1, round(ms(tokenizer_s)), round(ms(compile_s)), round(ms(tokenizer_s + compile_s)),
             round(ms(check_s), 1), round(ms(grammar_s), 1), round(ms(matcher_s), 1)]
        )  # fmt: skip
    print_table(
        ["cold run", "tokenizer build ms", "compile ms (fresh compiler)", "both ms", "of which: check_schema ms",
         "grammar_from_json_schema ms", "LLMatcher ms"],
        cold_rows,
    )  # fmt: skip
    print(f"Goal: compile < 2 s (median {ms(statistics.median(totals)):.0f} ms, tokenizer apart).\n")

    # The cached case: the engine's own compiler, warmed with the schema.
    prompt = chat(engine, TOOL_PROMPTS[:1])[0]
    with_grammar = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=spec)
    without = SamplingParams(temperature=0.0, max_tokens=1)
    engine.prepare_request("warm", None, with_grammar, prompt_token_ids=prompt)
    prepare: dict[str, list[float]] = {"no grammar": [], "cached grammar": []}
    for i in range(args.prepare_iters):
        for name, params in (("no grammar", without), ("cached grammar", with_grammar)):
            started = time.perf_counter()
            engine.prepare_request(f"p{i}", None, params, prompt_token_ids=prompt)
            prepare[name].append(time.perf_counter() - started)
    ttft: dict[str, list[float]] = {"no grammar": [], "cached grammar": []}
    for i in range(args.ttft_iters):
        order = (("no grammar", without), ("cached grammar", with_grammar))
        for name, params in order if i % 2 == 0 else reversed(order):
            started = time.perf_counter()
            engine.generate([prompt], params)
            ttft[name].append(time.perf_counter() - started)
    rows = []
    for name in prepare:
        rows.append(
            [name, round(ms(statistics.median(prepare[name])), 3), round(ms(percentile(prepare[name], 99)), 3),
             round(ms(statistics.median(ttft[name])), 2), round(ms(min(ttft[name])), 2)]
        )  # fmt: skip
    added_prepare = statistics.median(prepare["cached grammar"]) - statistics.median(prepare["no grammar"])
    # Paired: each iteration ran both, one after the other.
    added_ttft = statistics.median(
        [b - a for a, b in zip(ttft["no grammar"], ttft["cached grammar"], strict=True)]
    )
    rows.append(
        ["added by the cached grammar (paired median for TTFT)", round(ms(added_prepare), 3), "",
         round(ms(added_ttft), 2), ""]
    )  # fmt: skip
    compiled = engine.grammars.compile(spec)
    copies = []
    for _ in range(args.prepare_iters):
        started = time.perf_counter()
        compiled.new_state()
        copies.append(time.perf_counter() - started)
    rows.append(
        ["of which: the matcher copy in add_prepared (new_state)", "-", "-",
         round(ms(statistics.median(copies)), 3), round(ms(min(copies)), 3)]
    )  # fmt: skip
    print(f"A second request with the cached schema ({len(prompt)}-token prompt, max_tokens 1):\n")
    print_table(
        ["request", "prepare_request median ms", "p99 ms", "TTFT (generate) median ms", "min ms"], rows
    )
    print("Goal: the cached grammar adds < 5 ms to TTFT.\n")


# ---- part 4: pathological schemas beside live streams ---------------------------------------


def binary_nest(depth: int, tag: int) -> dict[str, Any]:
    """anyOf nest: each level an object or an array over the level below, both inline, so the
    schema doubles in size with each level."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {"a": schema}, "required": ["a"]},
                            {"type": "array", "items": schema}]}  # fmt: skip
    return {"description": f"request {tag}", **schema}  # a new cache key each time


def allof_nest(depth: int, tag: int) -> dict[str, Any]:
    """anyOf nest through $defs, each branch an allOf of the level below and one more property:
    a few KB whose intersections multiply with depth."""
    defs = {}
    for i in range(depth):
        below = (
            {"$ref": f"#/$defs/d{i + 1}"}
            if i + 1 < depth
            else {"type": "object", "description": f"leaf {tag}"}
        )
        defs[f"d{i}"] = {"anyOf": [
            {"allOf": [below, {"type": "object", "properties": {f"x{i}": {"type": "string"}}, "required": [f"x{i}"]}]},
            {"allOf": [below, {"type": "object", "properties": {f"y{i}": {"type": "integer"}}, "required": [f"y{i}"]}]},
        ]}  # fmt: skip
    return {"$defs": defs, "$ref": "#/$defs/d0"}


FIRST_GRAMMAR = "first grammar of the engine: the 10-field schema"
# What is sent mid-stream: the name, the schema for a tag (a new cache key each round).
SENT: dict[str, Callable[[int], dict[str, Any]]] = {
    # A fresh compiler each round: llguidance's tokenizer is built for this request.
    FIRST_GRAMMAR: lambda tag: {"description": f"request {tag}", **PERSON_SCHEMA},
    # The rest with the tokenizer already built.
    "anyOf/allOf nest via $defs, depth 16": lambda tag: allof_nest(16, tag),
    "anyOf nest inline, depth 16": lambda tag: binary_nest(16, tag),
    "anyOf nest inline, depth 12": lambda tag: binary_nest(12, tag),
    "anyOf of 60,000 empty schemas": lambda tag: {"description": f"request {tag}", "anyOf": [{}] * 60_000},
}


SERVER_FIRST_GRAMMAR = "first grammar of the server: the 10-field schema"
# Through HTTP the body's shape bounds (runtime/server/json_shape.py: 64 levels, 16,384 objects and
# arrays) come first: the schemas that reach the compiler are smaller than the engine level's.
SERVER_SENT: dict[str, Callable[[int], dict[str, Any]]] = {
    SERVER_FIRST_GRAMMAR: lambda tag: {"description": f"request {tag}", **PERSON_SCHEMA},
    "anyOf/allOf nest via $defs, depth 16": lambda tag: allof_nest(16, tag),
    "anyOf nest inline, depth 16": lambda tag: binary_nest(16, tag),
    "anyOf nest inline, depth 11": lambda tag: binary_nest(11, tag),
    "anyOf of 16,000 empty schemas": lambda tag: {"description": f"request {tag}", "anyOf": [{}] * 16_000},
}


@dataclasses.dataclass
class StreamRound:
    gaps: list[tuple[float, float]]  # (arrival since the streams started, seconds since the previous token)
    outcome: str = ""
    refused_after: float = float("nan")  # seconds from sending the schema to its answer
    sent_at: float = float("nan")  # since the streams started
    compile_until: float = float("nan")  # when the compile's work ended (since the streams started)


async def stream_round(
    aengine: AsyncEngine,
    prompts: list[list[int]],
    tokens: int,
    tag: str,
    schema: dict[str, Any] | None,
    send_after: float,
) -> StreamRound:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    result = StreamRound([])

    async def stream(index: int) -> None:
        last = None
        async for _ in aengine.generate(f"{tag}-{index}", None, params, prompt_token_ids=prompts[index]):
            now = time.perf_counter()
            if last is not None:
                result.gaps.append((now - start, now - last))
            last = now

    def send() -> None:
        assert schema is not None
        began = time.perf_counter()
        result.sent_at = began - start
        spec = parse_structured_outputs({"json": schema})  # what the server does with the body
        request = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=spec)
        try:
            aengine.prepare_request(f"{tag}-schema", None, request, prompt_token_ids=prompts[0])
            result.outcome = "accepted"
        except InvalidParameterError as error:
            result.outcome = error.message.splitlines()[0][:90]
        result.refused_after = time.perf_counter() - began
        # A compile past its deadline goes on in the background: wait for it (a retry returns
        # its result once done) to know how long the streams shared the machine with it.
        while True:
            try:
                aengine.engine.grammars.compile(spec)
                break
            except InvalidParameterError as error:
                if "did not compile within" not in error.message:
                    break
        result.compile_until = time.perf_counter() - start

    tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
    sender = None
    if schema is not None:
        await asyncio.sleep(send_after)
        sender = threading.Thread(target=send, name="bench-schema")  # a server worker thread
        sender.start()
    await asyncio.gather(*tasks)
    if sender is not None:
        sender.join()
    return result


def part_pathological(engine: LLMEngine, args: argparse.Namespace) -> None:
    print("## 4. Schemas sent beside 4 streams, engine level (AsyncEngine; a thread preparing)\n")
    limit = engine.config.grammar_limits
    print(
        f"  compile deadline {limit.compile_timeout_s:g} s, max spec {limit.max_spec_bytes:,} bytes, "
        f"max grammar size {limit.max_grammar_size:,}\n"
    )
    prompts = chat(engine, PERSON_PROMPTS[:4])
    aengine = AsyncEngine(engine)
    pairs: dict[str, list[Pair]] = {name: [] for name in SENT}
    try:
        asyncio.run(stream_round(aengine, prompts, 32, "warm", None, 0.0))
        tag = 0
        for r in range(args.stream_rounds):
            for name in SENT:  # each schema right after a baseline of its own: the load drifts
                results = []
                for schema in (None, SENT[name](tag)):
                    tag += 1
                    if schema is not None and name == FIRST_GRAMMAR:  # as a server's first grammar
                        engine.grammars.close()
                        engine.grammars = fresh_compiler(engine)
                    else:
                        engine.grammars.tokenizer()
                    results.append(
                        asyncio.run(
                            stream_round(
                                aengine, prompts, args.stream_tokens, f"s{tag}", schema, args.send_after
                            )
                        )
                    )
                pairs[name].append(Pair(*results))
                print_round(r, name, pairs[name][-1])
    finally:
        aengine.shutdown()
    report_streams(pairs, SENT, limit.compile_timeout_s)


def part_pathological_served(args: argparse.Namespace) -> None:
    from _served import served

    print("## 4. Schemas sent beside 4 streams, through `kvasir serve` (HTTP, streamed chat completions)\n")
    limit = GrammarLimits()
    print(f"  a fresh server each round, one torch thread, compile deadline {limit.compile_timeout_s:g} s\n")
    pairs: dict[str, list[Pair]] = {name: [] for name in SERVER_SENT}
    tag = 0
    for r in range(args.stream_rounds):
        with served("embedded", 2048, 256 << 20) as (url, _):
            asyncio.run(served_round(url, 32, None, 0.0))  # warm-up
            for name in SERVER_SENT:  # the server's first grammar first; each right after a baseline
                tag += 1
                baseline = asyncio.run(served_round(url, args.stream_tokens, None, args.send_after))
                body = schema_request(SERVER_SENT[name](tag))
                pairs[name].append(
                    Pair(baseline, asyncio.run(served_round(url, args.stream_tokens, body, args.send_after)))
                )
                print_round(r, name, pairs[name][-1])
    report_streams(pairs, SERVER_SENT, limit.compile_timeout_s)


def schema_request(schema: dict[str, Any]) -> bytes:
    """A chat completion constrained by `schema` (vLLM's structured_outputs), as the bytes sent."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": PERSON_PROMPTS[0]}],
        "max_tokens": 1,
        "temperature": 0,
        "structured_outputs": {"json": schema},
    }
    return canonical_json(body).encode()


async def served_round(url: str, tokens: int, schema_body: bytes | None, send_after: float) -> StreamRound:
    """4 streamed chat completions; `schema_body` posted `send_after` seconds in (then again while
    its answer is the deadline's, to see when its compile ends)."""
    import httpx

    start = time.perf_counter()
    result = StreamRound([])
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:

        async def stream(index: int) -> None:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": PERSON_PROMPTS[index]}],
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            last = None
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            result.gaps.append((now - start, now - last))
                        last = now

        async def post(body: bytes) -> str:
            response = await client.post(
                f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            if response.status_code == 200:
                return "accepted"
            message = str(response.json().get("error", {}).get("message", response.text))
            return f"{response.status_code}: {message.splitlines()[0][:90]}"

        async def send(body: bytes) -> None:
            await asyncio.sleep(send_after)
            began = time.perf_counter()
            result.sent_at = began - start
            result.outcome = await post(body)
            result.refused_after = time.perf_counter() - began
            outcome = result.outcome
            while "did not compile within" in outcome:  # the compile goes on in the background
                outcome = await post(body)
            result.compile_until = time.perf_counter() - start

        sender = [send(schema_body)] if schema_body is not None else []
        await asyncio.gather(*(stream(i) for i in range(4)), *sender)
    return result


@dataclasses.dataclass(frozen=True)
class Pair:
    """The same 4 streams without a schema, then with one sent mid-stream."""

    baseline: StreamRound
    sent: StreamRound


def print_round(index: int, name: str, pair: Pair) -> None:
    p99 = [ms(percentile([g for _, g in r.gaps], 99)) for r in (pair.baseline, pair.sent)]
    print(
        f"  round {index + 1}, {name}: ITL p99 {p99[0]:.1f} ms without, {p99[1]:.1f} ms with; "
        f"answered in {pair.sent.refused_after:.2f} s: {pair.sent.outcome}",
        flush=True,
    )


def report_streams(
    pairs: dict[str, list[Pair]], sent: dict[str, Callable[[int], dict[str, Any]]], deadline: float
) -> None:
    rows = []
    for name in sent:
        base = [pair.baseline for pair in pairs[name]]
        results = [pair.sent for pair in pairs[name]]
        base_gaps = [g for result in base for _, g in result.gaps]
        gaps = [g for result in results for _, g in result.gaps]
        # The gaps that overlap the compile's work, against the paired baseline's gaps over the same
        # seconds (a stalled stream has few, long gaps there).
        during = [g for result in results for t, g in result.gaps if overlaps(t, g, result)]
        base_during = [
            g for result, b in zip(results, base, strict=True) for t, g in b.gaps if overlaps(t, g, result)
        ]
        rows.append(
            [name, f"{len(canonical_json(sent[name](0)).encode()):,}", max(r.refused_after for r in results),
             statistics.fmean([r.compile_until - r.sent_at for r in results]),
             round(ms(percentile(base_gaps, 99)), 1), round(ms(percentile(gaps, 99)), 1),
             round(percentile(gaps, 99) / percentile(base_gaps, 99), 2),
             round(ms(max(base_gaps)), 1), round(ms(max(gaps)), 1), len(during),
             round(ms(percentile(base_during, 99)), 1), round(ms(percentile(during, 99)), 1),
             round(percentile(during, 99) / percentile(base_during, 99), 2)]
        )  # fmt: skip
    print()
    print_table(
        ["sent mid-stream", "schema bytes", "answered after s (max)", "compile busy s (mean)",
         "ITL p99 ms without", "with", "ratio", "ITL max ms without", "with",
         "gaps while compiling", "their p99 ms without", "with", "ratio"],
        rows,
    )  # fmt: skip
    print("Answers (first round):")
    for name in sent:
        print(f"  {name}: {pairs[name][0].sent.outcome}")
    print(
        "\nEach schema's streams right after the same streams without it ('without'), whole streams and\n"
        "over the seconds its compile worked ('compile busy': from sending to the end of the compile's\n"
        "work; past the deadline it goes on in the background): the inter-token gaps that overlap that\n"
        "window, against the baseline's over the same seconds (few gaps: p99 is about their max).\n"
        f"Goal: refused within the deadline ({deadline:g} s), ITL p99 <= 1.5x baseline.\n"
    )


def overlaps(arrival: float, gap: float, result: StreamRound) -> bool:
    """Whether the gap that ended at `arrival` overlaps the window from sending to the compile's end."""
    return arrival >= result.sent_at and arrival - gap <= result.compile_until


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="1,2,3,4", help="comma-separated parts to run (1-4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see docs)")
    parser.add_argument("--quick", action="store_true", help="fewer tokens, rounds and repetitions")
    parser.add_argument("--tools", type=int, default=50, help="tools in the 'required' schema")
    parser.add_argument("--mask-tokens", type=int, default=128, help="max tokens of part 1's generations")
    parser.add_argument("--replays", type=int, default=3, help="warm passes over part 1's outputs")
    parser.add_argument("--apply-iters", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=112, help="output tokens per request in part 2")
    parser.add_argument("--rounds", type=int, default=8, help="alternating A/B rounds in part 2")
    parser.add_argument("--compile-repeats", type=int, default=3, help="cold compiles in part 3")
    parser.add_argument("--prepare-iters", type=int, default=200)
    parser.add_argument("--ttft-iters", type=int, default=20)
    parser.add_argument("--stream-tokens", type=int, default=512, help="tokens of each of part 4's streams")
    parser.add_argument(
        "--stream-rounds", type=int, default=2, help="rounds of part 4 (each: baseline + schemas)"
    )
    parser.add_argument(
        "--send-after", type=float, default=1.5, help="seconds into the streams the schema is sent"
    )
    parser.add_argument(
        "--level",
        choices=("server", "engine"),
        default="server",
        help="part 4 through `kvasir serve` over HTTP (default) or at the engine level (AsyncEngine)",
    )
    args = parser.parse_args()
    if args.quick:
        args.mask_tokens, args.replays, args.max_tokens, args.rounds = 64, 1, 64, 2
        args.compile_repeats, args.prepare_iters, args.ttft_iters = 1, 50, 4
        args.stream_tokens, args.stream_rounds = 400, 1
    parts = {int(p) for p in args.parts.split(",")}
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    print_header("Structured output: mask, time per token, compile, pathological schemas (embedded model)")
    print(f"llguidance {llguidance.__version__}; batch {BATCH}; greedy\n")
    engine = build_engine() if parts & {1, 2, 3} or args.level == "engine" else None
    try:
        if engine is not None and 1 in parts:
            part_mask(engine, args)
        if engine is not None and 2 in parts:
            part_tpot(engine, args)
        if engine is not None and 3 in parts:
            part_compile(engine, args)
        if 4 in parts:
            if args.level == "server":
                part_pathological_served(args)
            else:
                assert engine is not None
                part_pathological(engine, args)
    finally:
        if engine is not None:
            engine.close()


if __name__ == "__main__":
    main()
