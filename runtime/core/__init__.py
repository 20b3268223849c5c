"""The scheduler's side of a step, pure Python (no torch): requests, their queue, the KV-cache block manager and the scheduler."""
