"""The runtime's subcommands of `kvasir`: `generate` (an offline batch) and `serve` (the HTTP API)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from kvasir.runtime.engine.outputs import GenerationResult
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.server.config import add_server_args, server_config_from_args

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"extra"}
_TUPLE_FIELDS = {"stop", "stop_token_ids"}


def register(subparsers: Any) -> None:
    """Add the runtime's subcommands to the top-level `kvasir` parser."""
    generate = subparsers.add_parser(
        "generate",
        help="run an offline batch of prompts from a JSONL file",
        description="Each input line is an object with `prompt` (a string), `prompt_token_ids` or "
        "`messages` (chat, rendered with the model's chat template), "
        "plus any sampling parameter (max_tokens, temperature, top_p, seed, n, stop, ...).",
    )
    generate.add_argument("--input", "-i", required=True, help="JSONL prompts ('-' for stdin)")
    generate.add_argument("--output", "-o", help="JSONL results (default: stdout)")
    add_engine_args(generate)
    generate.set_defaults(handler=run_generate)

    serve = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API (with /metrics, /health, /ready)",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /health, /ready, /metrics, /version. SIGTERM drains gracefully. "
        "Tracing is configured by the standard OTEL_* variables (off by default).",
    )
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=run_serve)


class InputError(ValueError):
    """A line of the input file is not a valid request."""


Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


def read_requests(stream: TextIO) -> Iterator[tuple[Prompt, SamplingParams]]:
    """Parse JSONL request lines; errors name the line number and the field."""
    for line_number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"line {line_number}: not valid JSON ({error.msg})") from None
        if not isinstance(item, dict):
            raise InputError(f"line {line_number}: expected a JSON object")
        prompt = item.pop("prompt", None)
        token_ids = item.pop("prompt_token_ids", None)
        messages = item.pop("messages", None)
        if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
            raise InputError(
                f"line {line_number}: give exactly one of 'prompt', 'prompt_token_ids' or 'messages'"
            )
        if messages is not None and not (
            isinstance(messages, list)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        ):
            raise InputError(
                f"line {line_number}: 'messages' must be a list of objects with 'role' and 'content'"
            )
        if prompt is not None and not isinstance(prompt, str):
            raise InputError(f"line {line_number}: 'prompt' must be a string")
        if token_ids is not None and not (
            isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids)
        ):
            raise InputError(f"line {line_number}: 'prompt_token_ids' must be a list of integers")
        unknown = sorted(set(item) - _PARAM_FIELDS)
        if unknown:
            raise InputError(f"line {line_number}: unknown field(s) {', '.join(unknown)}")
        if isinstance(item.get("stop"), str):
            item["stop"] = [item["stop"]]
        for name in _TUPLE_FIELDS & set(item):
            if isinstance(item[name], list):
                item[name] = tuple(item[name])
        try:
            params = SamplingParams(**item)
        except InvalidParameterError as error:
            raise InputError(f"line {line_number}: {error}") from None
        source = next(x for x in (prompt, token_ids, messages) if x is not None)
        yield source, params


def result_record(index: int, result: GenerationResult) -> dict[str, Any]:
    """One output line, the same shape whatever `n` is: the request's index, its prompt length, and
    its choices (each with its index, text, token ids, finish and stop reason), as in OpenAI's API."""
    return {
        "index": index,
        "prompt_tokens": result.num_prompt_tokens,
        "choices": [
            {
                "index": choice.index,
                "text": choice.text,
                "token_ids": choice.token_ids,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            for choice in result.choices
        ],
    }


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.loader.errors import ModelLoadError
    from kvasir.runtime.worker.threads import apply_threads

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")  # noqa: SIM115
        with source:
            requests = list(read_requests(source))
    except (OSError, InputError) as error:
        print(f"error: {args.input}: {error}", file=sys.stderr)
        return 2
    if not requests:
        print(f"error: {args.input}: no requests", file=sys.stderr)
        return 2
    apply_threads(args.threads)
    try:
        engine = LLMEngine(engine_config_from_args(args))
    except (ModelLoadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    prompts: list[str | list[int]] = []
    for prompt, _ in requests:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompts.append(engine.tokenizer.encode_chat(prompt))  # chat messages
        else:
            prompts.append(prompt)  # type: ignore[arg-type]
    params = [p for _, p in requests]
    started = time.perf_counter()
    with tqdm(total=len(requests), desc="generate", unit="req", file=sys.stderr) as bar:

        def advance(_: GenerationResult) -> None:
            bar.update()

        try:
            results = engine.generate(prompts, params, on_finish=advance)
        except InvalidParameterError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    elapsed = time.perf_counter() - started

    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115
    try:
        for index, result in enumerate(results):
            out.write(json.dumps(result_record(index, result), ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()

    prompt_tokens = sum(r.num_prompt_tokens * len(r.choices) for r in results)
    output_tokens = sum(len(c.token_ids) for r in results for c in r.choices)
    print(
        f"{len(results)} requests in {elapsed:.2f}s: {len(results) / elapsed:.2f} req/s, "
        f"{output_tokens / elapsed:.1f} output tokens/s, "
        f"{(prompt_tokens + output_tokens) / elapsed:.1f} total tokens/s "
        f"({prompt_tokens} prompt + {output_tokens} output tokens)",
        file=sys.stderr,
    )
    if args.output:
        print(f"wrote {Path(args.output)}", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from kvasir.runtime.server.runner import run_server

    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
        return run_server(engine_config, server_config, threads=args.threads)
    except ValueError as error:  # a bad flag or OTEL_* setting, found before serving
        print(f"error: {error}", file=sys.stderr)
        return 2
