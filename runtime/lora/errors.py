"""The one error a bad LoRA adapter raises, torch-free so the server can catch it without the worker.

An adapter directory is untrusted input (a user names it through the API): every problem found in
it is a `LoRAAdapterError` whose message is one line naming the file and field at fault, fit to be
sent back as an HTTP 400 as it is.
"""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message names the file and field, on one line."""
