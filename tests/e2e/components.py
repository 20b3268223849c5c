"""The processes of a throwaway control plane: start one with its output in a log file, wait until
its health endpoint answers, stop it. A start failure raises with the tail of the component's log."""

from __future__ import annotations

import contextlib
import signal
import ssl
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


class ComponentError(RuntimeError):
    """A control-plane component did not start; the message carries the tail of its log."""


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the component's log, for error messages."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def failure(self, reason: str) -> ComponentError:
        return ComponentError(f"{self.name} {reason}; the end of {self.log}:\n{self.tail()}")


def start(name: str, command: Sequence[str], log_dir: Path) -> Component:
    """Start `command` with stdout and stderr in `log_dir/<name>.log`."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as output:
        # Its own session: a Ctrl-C in the terminal reaches pytest, whose teardown stops the component
        # in order, instead of killing the API server under the controllers.
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Component(name, process, log)


def wait_healthy(
    component: Component,
    url: str,
    timeout: float,
    verify: ssl.SSLContext | bool = False,
    headers: dict[str, str] | None = None,
) -> None:
    """Poll `url` until it answers 200; ComponentError if the process exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with httpx.Client(verify=verify, headers=headers, timeout=2.0) as client:
        while time.monotonic() < deadline:
            code = component.process.poll()
            if code is not None:
                raise component.failure(f"exited with code {code} while starting")
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:2000]}"
            except httpx.HTTPError as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(0.2)
    raise component.failure(f"was not healthy at {url} within {timeout:.0f}s (last: {last})")


def stop(component: Component, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns once the process is gone."""
    process = component.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)
