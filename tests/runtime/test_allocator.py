"""release_free_memory gives back what a thread freed in its own glibc arena (glibc keeps it for
that arena's later mallocs otherwise). Runs in a fresh interpreter: RSS is process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import ctypes, json, threading
    from kvasir.runtime.allocator import release_free_memory

    def resident():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def churn():  # 64 MiB in 64 KiB blocks (under the mmap threshold: from this thread's arena)
        blocks = [libc.malloc(64 << 10) for _ in range(1024)]
        for block in blocks:
            ctypes.memset(block, 1, 64 << 10)
        keep = blocks.pop()  # a live block at the end: the arena cannot simply shrink its top
        for block in blocks:
            libc.free(block)

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    before = resident()
    released = release_free_memory()
    print(json.dumps({"released": released, "freed_mib": (before - resident()) / 2**20}))
    """
)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim"
)
def test_memory_a_thread_freed_leaves_the_resident_set() -> None:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["released"] is True
    assert result["freed_mib"] > 48  # of the 64 MiB freed
