"""Give the C heap's free pages back to the system once the model has loaded.

Loading leaves freed memory behind in glibc's heaps: the transient copies of a repack (the
embedding's codes before packing, about 28 MiB for the embedded model), the file's metadata,
the tokenizer's build. glibc keeps it for later `malloc`s, but only of the thread whose arena
holds it: the model loads on one thread and steps on another, so the steps never reuse it and
the server's peak under load sits that much higher. `malloc_trim(0)` returns every whole free
page of every arena (glibc 2.8 and later), once, at start-up, before the server turns ready.

A C library other than glibc (musl, macOS) has no `malloc_trim`: then this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)


def release_free_memory() -> bool:
    """Return the C heap's whole free pages to the system; True if glibc did release some."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
