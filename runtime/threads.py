"""How many CPU threads torch may use: chosen at start-up, printed, never oversubscribed.

torch's default is one thread per core it can see. Inside a container that is the node's cores,
not the pod's CPU limit (a CFS quota, invisible to affinity): a pod limited to 2 CPUs on a 64-core
node would run 64 threads in 2 CPUs' time, each parallel region waiting at its barrier for
threads the quota has descheduled. So the default is the CPUs this process may really use (its
affinity, then the cgroup quota), whole, and at least one. Measured side by side on a quiet
2-core machine (docs/benchmarks.md, "GGUF on CPU against llama.cpp"), two threads served 1.22x,
1.27x and 1.43x the tokens/s of one at 1, 8 and 32 streams: the server's own threads (event loop,
HTTP) take little CPU and do not need a core kept for them. On a machine shared with other busy
processes, fewer threads than cores is faster (a barrier waits for a preempted thread): with the
default count the engine re-chooses from its own step times (`runtime/thread_tuner.py`), and
`--threads` (or `KVASIR_THREADS`, or `OMP_NUM_THREADS`) fixes the count as the user's choice.

How long a thread that waits at a barrier spins before it sleeps is libgomp's `GOMP_SPINCOUNT`
(300,000 turns by default, a few hundred microseconds). A decode step of a small model runs some
120 parallel regions; when another busy process holds the second core, each spinning wait burns
the slice the preempted partner needs (measured: 2 threads fell from 222 to 77 tokens/s next to
one busy loop, and to 4 tokens/s under a test suite's load). `short_spin_wait` sets 1,000 turns
when `kvasir.runtime` is imported before torch (as `kvasir serve` and `generate` do): on a quiet
machine it costs little (2-9% of a server's tokens/s), and the waiting thread sleeps soon enough
for the scheduler to run the partner (docs/benchmarks.md, "Kvasir's CPU thread default"). `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`, when set, are the user's choice."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def available_cpus() -> float:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota (v2, then v1)."""
    cpus: float = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return min(cpus, quota) if quota is not None else cpus


def _cgroup_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def default_threads(cpus: float) -> int:
    """Every whole CPU the process may use, and at least one."""
    return max(1, math.floor(cpus))


def choose_threads(requested: int | None) -> tuple[int, str]:
    """(threads, why) for `--threads` (None: not given)."""
    if requested is not None:
        return requested, "--threads or KVASIR_THREADS"
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    cpus = available_cpus()
    return default_threads(cpus), f"{cpus:g} CPUs usable"


SPIN_ENV, WAIT_POLICY_ENV = "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"
# Barrier spin turns: 300 lost 40% on a quiet machine, 1,000 and 3,000 nothing (docs/benchmarks.md).
SHORT_SPIN = 1000


def short_spin_wait() -> None:
    """Make OpenMP's waiting threads spin briefly (see the module docstring), unless the user chose
    a wait policy. Effective only before libgomp loads (before `import torch`): call it first."""
    if SPIN_ENV not in os.environ and WAIT_POLICY_ENV not in os.environ:
        os.environ[SPIN_ENV] = str(SHORT_SPIN)


# The count `apply_threads` chose by default (nobody asked for one), else None.
_default_chosen: int | None = None


def apply_threads(requested: int | None) -> int:
    """Set torch's intra-op threads once, and say so in the log."""
    import torch

    global _default_chosen
    threads, why = choose_threads(requested)
    torch.set_num_threads(threads)
    _default_chosen = threads if requested is None and why.endswith("CPUs usable") else None
    logger.info("CPU threads: %d (%s; --threads to change)", threads, why)
    return threads


def set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def torch_threads() -> int:
    """torch's intra-op threads now (what the C kernels run on too)."""
    import torch

    return torch.get_num_threads()


def tunable_thread_counts() -> tuple[int, int] | None:
    """(the default count, one) when `apply_threads` chose more than one thread by default: the
    counts the engine may switch between as it measures (`runtime/thread_tuner.py`); None where a
    user chose or there is one CPU."""
    if _default_chosen is None or _default_chosen < 2:
        return None
    return _default_chosen, 1
