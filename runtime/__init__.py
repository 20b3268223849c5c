"""Kvasir runtime: engine, scheduler, KV cache manager, models, sampler."""
