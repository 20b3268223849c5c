"""The runtime's subcommands of `kvasir`: `generate` (an offline batch) and `serve` (the HTTP API)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.outputs import GenerationResult
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.server.config import add_server_args, server_config_from_args


def register(subparsers: Any) -> None:
    """Add the runtime's subcommands to the top-level `kvasir` parser."""
    generate = subparsers.add_parser(
        "generate",
        help="run an offline batch of prompts from a JSONL file",
        description="Each input line is an object with `prompt` (a string), `prompt_token_ids` or "
        "`messages` (chat, rendered with the model's chat template), "
        "plus any sampling parameter (max_tokens, temperature, top_p, seed, n, stop, ...). Every line is "
        "checked before the model's weights load; if any is bad, each bad one is reported (file and line) "
        "and nothing runs (exit status 2).",
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


def result_record(
    index: int, result: GenerationResult, tool_calls: list[list[dict[str, Any]] | None] | None = None
) -> dict[str, Any]:
    """One output line, the same shape whatever `n` is: the request's index, its prompt length, and
    its choices (each with its index, text, token ids, finish and stop reason, and, for a line with
    tools, the `tool_calls` read from it), as in OpenAI's API."""
    choices = []
    for number, choice in enumerate(result.choices):
        record: dict[str, Any] = {
            "index": choice.index,
            "text": choice.text,
            "token_ids": choice.token_ids,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        calls = tool_calls[number] if tool_calls is not None else None
        if calls is not None:
            record["tool_calls"] = calls
        choices.append(record)
    return {"index": index, "prompt_tokens": result.num_prompt_tokens, "choices": choices}


def run_generate(args: argparse.Namespace) -> int:
    """Check every input line (before the weights load), generate, write one line per request."""
    from tqdm import tqdm

    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.engine.prompt_check import PromptCheck
    from kvasir.runtime.engine.ranks.supervisor import RankFailure
    from kvasir.runtime.generate_input import choice_tool_calls, prepare_lines, read_lines
    from kvasir.runtime.loader.errors import ModelLoadError
    from kvasir.runtime.loader.model_files import open_engine_model
    from kvasir.runtime.structured.compiler import GrammarCompiler
    from kvasir.runtime.threads import apply_threads

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    name = "<stdin>" if args.input == "-" else args.input
    try:
        source = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")  # noqa: SIM115
        with source:
            lines, errors = read_lines(source)
    except OSError as error:
        return _fail(f"{name}: {error.strerror or error}")
    if errors:
        return _fail_lines(name, errors)
    if not lines:
        return _fail(f"{name}: no requests")
    try:
        output = ResultsFile(args.output)  # before the model loads: an unwritable path fails now
    except OSError as error:
        return _fail(f"--output {args.output}: {error.strerror or error}")
    with output:
        try:
            config = engine_config_from_args(args)
            if config.node_rank > 0:
                raise ValueError(
                    "kvasir generate runs node 0 of a multi-node group; start the other nodes "
                    "with kvasir serve --headless"
                )
            check_kv_events(config)
            files = open_engine_model(config)
        except (ModelLoadError, ValueError) as error:
            return _fail(str(error))
        # Grammars too are checked before the weights load (the engine compiles its own again).
        grammars = GrammarCompiler(
            files.tokenizer.backend.to_str,
            files.config.vocab_size,
            files.tokenizer.eos_token_ids or files.config.eos_token_ids,
            config.grammar_limits,
        )
        try:
            prepared, errors = prepare_lines(lines, PromptCheck.for_model(config, files), grammars.compile)
        finally:
            grammars.close()
        if errors:
            return _fail_lines(name, errors)
        apply_threads(args.threads)
        try:
            engine = LLMEngine(config, files)
        except (ModelLoadError, ValueError, RankFailure) as error:
            return _fail(str(error))
        started = time.perf_counter()
        try:
            with tqdm(total=len(prepared), desc="generate", unit="req", file=sys.stderr) as bar:

                def advance(_: GenerationResult) -> None:
                    bar.update()

                # The token ids prepare_lines checked: nothing is tokenized twice.
                results = engine.generate(
                    [p.prompt_token_ids for p in prepared], [p.params for p in prepared], on_finish=advance
                )
        except RankFailure as error:  # a tensor-parallel rank died or hung: one line, exit 1
            return _fail(str(error))
        finally:
            engine.close()  # with --tensor-parallel-size, the other ranks exit now
        elapsed = time.perf_counter() - started
        for index, (line, result) in enumerate(zip(lines, results, strict=True)):
            calls = choice_tool_calls(line, files.tokenizer, result)
            output.write(json.dumps(result_record(index, result, calls), ensure_ascii=False) + "\n")
        output.commit()

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


# Bad lines reported one per line, up to this many (then a count): enough to fix a batch in one go.
MAX_REPORTED_LINES = 20


def _fail(message: str) -> int:
    print(f"kvasir generate: {message}", file=sys.stderr)
    return 2


def _fail_lines(name: str, errors: list[Any]) -> int:  # InputError: generate_input loads lazily (torch)
    for error in errors[:MAX_REPORTED_LINES]:
        print(f"kvasir generate: {name}: {error}", file=sys.stderr)
    if len(errors) > MAX_REPORTED_LINES:
        print(f"kvasir generate: {name}: {len(errors) - MAX_REPORTED_LINES} more bad lines", file=sys.stderr)
    print(f"kvasir generate: {name}: nothing generated: fix the lines above", file=sys.stderr)
    return 2


class ResultsFile:
    """Where results go: stdout, or a file that appears only once complete (written beside its
    final path and renamed), so a failed run never leaves half a results file behind."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._handle: TextIO = sys.stdout
        self._temp: str | None = None
        if path is not None:
            target = Path(path)
            if target.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            fd, self._temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
            self._handle = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, text: str) -> None:
        self._handle.write(text)

    def commit(self) -> None:
        if self._temp is not None and self.path is not None:
            self._handle.close()
            os.replace(self._temp, self.path)
            self._temp = None

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._temp is not None:  # not committed: a failure, leave nothing behind
            self._handle.close()
            os.unlink(self._temp)


def check_kv_events(config: EngineConfig) -> None:
    """The KV-events socket opened once before the model loads: an address in use or refused is a
    ValueError naming --kv-events-config now, not a traceback after loading."""
    events = config.kv_events_config
    if events is not None and events.active and config.enable_prefix_caching:
        from kvasir.runtime.engine.kv_events import check_endpoint

        check_endpoint(events)


def run_serve(args: argparse.Namespace) -> int:
    from kvasir.runtime.loader.errors import ModelLoadError
    from kvasir.runtime.loader.source import check_local_source
    from kvasir.runtime.server.headless import check_node_role, run_headless
    from kvasir.runtime.server.process_exit import exit_without_teardown
    from kvasir.runtime.server.runner import run_server

    try:  # what is found wrong before serving: a bad flag, an OTEL_* setting, a missing model path
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
        check_node_role(engine_config, server_config)
        check_local_source(engine_config.model)
        if server_config.headless:  # a worker node: its ranks and /health only
            return run_headless(engine_config, server_config, threads=args.threads)
        check_kv_events(engine_config)
        code = run_server(engine_config, server_config, threads=args.threads)
    except (ModelLoadError, ValueError) as error:
        print(f"kvasir serve: {error}", file=sys.stderr)
        return 2
    if engine_config.tensor_parallel_size > 1:  # its ranks are reaped; torch's group teardown can abort
        exit_without_teardown(code)
    return code
