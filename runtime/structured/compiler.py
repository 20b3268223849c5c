"""Compiling grammars off the engine thread, with a deadline and a cache.

`GrammarCompiler.compile(spec)` is called where a request is prepared (a server worker thread, or
`kvasir generate` before its batch runs), never on the engine's thread: a request waiting for its
grammar holds no step. Compiles run on a small pool of their own; the caller waits at most the
deadline, then gets a 400 naming the limit while the compile finishes in the background (its result
is cached, so a retry is instant). Equal specs share one compile, in flight or done, failures
included: a pathological schema costs its compile once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance

from kvasir.runtime.sample.params import InvalidParameterError
from kvasir.runtime.structured.grammar_text import grammar_text
from kvasir.runtime.structured.limits import GrammarLimits
from kvasir.runtime.structured.matcher import GrammarState
from kvasir.runtime.structured.params import StructuredOutputs
from kvasir.runtime.structured.schema_check import explain_engine_error
from kvasir.runtime.structured.stats import StructuredStats

logger = logging.getLogger(__name__)

# Compiles at once: each holds a core while it runs, and the engine needs the rest.
COMPILE_THREADS = 2


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready for requests: each sequence gets its own copy of the prototype matcher."""

    kind: str
    prototype: llguidance.LLMatcher
    compile_seconds: float

    def new_state(self) -> GrammarState:
        return GrammarState(self.prototype.deep_copy(), self.kind)


class GrammarCompiler:
    """Grammars for one tokenizer: compiled on a private pool, cached by spec, bounded by `limits`."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: GrammarLimits | None = None,
        stats: StructuredStats | None = None,
    ) -> None:
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size
        self.stats = stats or StructuredStats()
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="grammar-compile", initializer=_lower_thread_priority
        )
        self._parser_limits = llguidance.LLParserLimits(
            max_grammar_size=self.limits.max_grammar_size, verbose_errors=False
        )

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar for `spec`, waiting at most the deadline; InvalidParameterError
        naming `spec.param` for a grammar that is malformed, unenforceable or too costly."""
        future, cached = self._future(spec)
        try:
            compiled = future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            self.stats.count(spec.metric_kind, "deadline")
            raise InvalidParameterError(
                spec.param,
                f"did not compile within {self.limits.compile_timeout_s:g} s "
                "(--structured-outputs-compile-timeout); simplify the schema or grammar",
            ) from None
        except InvalidParameterError as error:
            self.stats.count(spec.metric_kind, "invalid")
            # The cached refusal named the field of the request that compiled it first.
            raise InvalidParameterError(spec.param, error.message) from None
        self.stats.count(spec.metric_kind, "cached" if cached else "compiled")
        return compiled

    def _future(self, spec: StructuredOutputs) -> tuple[Future[CompiledGrammar], bool]:
        """The spec's compile, shared with every request that asked for the same grammar; True
        when it was already there (done or running: this request did not start a compile)."""
        key = spec.cache_key
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future, True
            future = self._pool.submit(self._build, spec)
            self._cache[key] = future
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
            return future, False

    def _build(self, spec: StructuredOutputs) -> CompiledGrammar:
        """One compile, timed here (whoever waits for it, and however long a caller waited)."""
        started = time.perf_counter()
        try:
            return self._compile(spec)
        finally:
            self.stats.observe_compile(time.perf_counter() - started)

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        started = time.perf_counter()
        text = grammar_text(spec, self.limits)
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0, limits=self._parser_limits)
        if matcher.is_error():
            message = matcher.get_error()
            if "panic" in message:  # the engine's internal failure, not the user's fault
                message = "the grammar engine failed on it (an internal error); simplify it"
            if "too large" in message or "grammar size" in message:
                message += " (--structured-outputs-max-grammar-size)"
            if spec.kind == "json":
                raise explain_engine_error(json.loads(spec.value), message, spec.param)
            if spec.kind == "json_object":
                raise InvalidParameterError(spec.param, f"cannot be enforced: {message}")
            raise InvalidParameterError(spec.param, f"is not a valid {_KIND_NAMES[spec.kind]}: {message}")
        return CompiledGrammar(spec.kind, matcher, time.perf_counter() - started)

    def prepare(self) -> None:
        """Build the tokenizer as llguidance sees it (a quarter second for a 49k vocabulary, a
        second for 128k, holding the interpreter lock): at start-up, so the first request with a
        grammar does not stall every stream. A tokenizer llguidance cannot read leaves the model
        serving, and each request with a grammar gets a 400 saying why."""
        try:
            self.tokenizer()
        except InvalidParameterError as error:
            logger.warning("structured output is unavailable: %s", error.message)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, built once; InvalidParameterError if it cannot be."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                if self._tokenizer_error is None:
                    try:
                        self._tokenizer = llguidance.LLTokenizer(
                            self._tokenizer_json(),
                            n_vocab=self.vocab_size,
                            eos_token=list(self._eos_token_ids) or None,
                        )
                    except Exception as error:  # the bindings raise plain exceptions
                        self._tokenizer_error = (
                            f"the grammar engine cannot read this model's tokenizer ({error})"
                        )
                if self._tokenizer is None:
                    raise InvalidParameterError("structured_outputs", self._tokenizer_error or "")
            return self._tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_KIND_NAMES = {
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
    "tool_calls": "set of tool schemas",
}


# How much lower than the engine's threads a compile runs (nice +10): a pathological schema's
# compile takes a core the decode steps would otherwise get; at a lower priority the scheduler
# gives the steps their CPU first, and the compile what is left.
COMPILE_NICENESS = 10


def _lower_thread_priority() -> None:
    """Lower this (compile) thread's CPU priority: Linux keeps a nice value per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: compile at normal priority
        logger.debug("could not lower the grammar compile threads' priority")
