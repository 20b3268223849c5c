"""The access log: one line per request with id, status, tokens and latency; JSON on request."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.logs import JsonFormatter
from tests.runtime.server.harness import MODEL, TIMEOUT, serve, tiny_engine_config


def test_one_access_line_per_request(
    tiny_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    app = build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig())
    caplog.set_level(logging.INFO, logger="kvasir.access")
    with serve(app) as server:
        ok = httpx.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
            timeout=TIMEOUT,
        )
        bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 0}, timeout=TIMEOUT)
        httpx.get(server.url + "/health", timeout=TIMEOUT)  # a probe: debug level, not logged here
        server.wait_idle()
    records = [r for r in caplog.records if r.name == "kvasir.access" and r.levelno == logging.INFO]
    assert [r.access["status"] for r in records] == [200, 400]  # type: ignore[attr-defined]
    line = records[0].access  # type: ignore[attr-defined]
    assert line["request_id"] == ok.json()["id"] and line["path"] == "/v1/completions"
    assert line["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"] and line["completion_tokens"] == 3
    assert line["finish_reason"] == "length" and line["latency_s"] > 0
    assert f"id={line['request_id']}" in records[0].getMessage()
    assert bad.status_code == 400 and records[1].access["request_id"] is None  # type: ignore[attr-defined]

    entry = json.loads(JsonFormatter().format(records[0]))
    assert entry["status"] == 200 and entry["completion_tokens"] == 3 and entry["logger"] == "kvasir.access"
