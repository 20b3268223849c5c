"""The bounds on compiling a grammar: a deadline, input sizes and the grammar engine's own limits.

Declared as engine settings (`--structured-outputs-*`), so every bound is a documented flag; the
compiler reads them from this record.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_COMPILE_TIMEOUT_S = 5.0
DEFAULT_MAX_SPEC_BYTES = 512 * 1024
DEFAULT_MAX_GRAMMAR_SIZE = 200_000
DEFAULT_MAX_WHITESPACE = 8
# Compiled grammars kept, by schema and tokenizer: a hit costs a matcher copy (tens of microseconds).
DEFAULT_CACHE_SIZE = 1024


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost to compile, and how much whitespace JSON output may hold."""

    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES
    # llguidance's `max_grammar_size`: symbols in the compiled grammar's productions.
    max_grammar_size: int = DEFAULT_MAX_GRAMMAR_SIZE
    # Whitespace characters allowed between two JSON tokens (0: compact JSON only). Bounded so a
    # model whose favourite token is a space still finishes its object.
    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    cache_size: int = DEFAULT_CACHE_SIZE
