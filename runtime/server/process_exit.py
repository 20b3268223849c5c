"""Ending a process whose torch distributed group has been in use, without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Flush the logs and standard streams, then `os._exit(code)`.

    Torch's TCPStore and gloo objects can abort the interpreter's exit ("terminate called without
    an active exception", status 134) after a clean stop: seen on a headless node whose store call
    to a frozen leader never returned, and in test ranks after `leave_group()`. A process that ran
    a group has nothing left to clean up once its ranks are reaped, so it skips that teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
