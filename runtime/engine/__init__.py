"""The glue: the synchronous LLMEngine, its thread-backed AsyncEngine, and the output side (detokenization, stop strings, per-request deltas)."""
