"""Structured output: a request's grammar (JSON schema, regex, choice, Lark), compiled off the engine
thread with a cache, advanced token by token, and turned into a per-row token bitmask the sampler
applies. The grammar engine (llguidance) is behind `compiler` and `matcher`; the rest is plain data."""
