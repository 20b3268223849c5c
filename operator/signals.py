"""SIGTERM and SIGINT as a graceful stop of the operator, in every phase.

kopf installs handlers of its own while its loop runs; a signal it catches stops the loop without
telling us why, which looked like a loop that stopped by itself (exit 1), and a standby, waiting
for the Lease before kopf ever ran, had no handler at all (killed: exit 143). So the operator
takes the two signals for itself: before kopf starts, again once kopf is ready (replacing kopf's),
and after kopf returns. A signal sets the one `stop` event; the runner stops kopf through its stop
flag, releases the Lease so that the standby takes over at once, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(stop: asyncio.Event) -> None:
    """Route SIGTERM and SIGINT to `stop` (on the running loop, which must be the main thread's)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, _stop, stop, sig)


def restore_signals() -> None:
    """Give SIGTERM and SIGINT back their default behaviour."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)


def _stop(stop: asyncio.Event, sig: signal.Signals) -> None:
    if not stop.is_set():
        logger.info("%s received: stopping (the Lease is released for the standby)", sig.name)
    stop.set()
