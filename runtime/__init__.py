"""Kvasir runtime: engine, scheduler, KV cache manager, models, sampler."""

import sys

from kvasir.runtime.threads import short_spin_wait

# libgomp reads its spin setting once, when torch loads it: set Kvasir's default here, before
# any runtime module imports torch (`kvasir serve` and `generate` import this package first).
if "torch" not in sys.modules:
    short_spin_wait()
