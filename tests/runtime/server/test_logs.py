"""The access log: one line per request with id, status, tokens and latency; JSON on request; and
whatever a client puts into a logged field, every record stays one line (tracebacks indented) with
no control characters, in both formats."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.logs import JsonFormatter, RequestLog, TextFormatter, access_text
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


# Anything a client can put in a field: every code point, surrogates and line breaks included.
CLIENT_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _access_record(log: RequestLog) -> logging.LogRecord:
    return logging.makeLogRecord(
        {
            "name": "kvasir.access",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": access_text(log),
            "access": asdict(log),
        }
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_no_field_of_an_access_line_can_break_or_colour_it(data: st.DataObject) -> None:
    """Every text field of the access line, present and future, is escaped in both formats."""
    text_fields = {f.name: data.draw(CLIENT_TEXT) for f in fields(RequestLog) if "str" in str(f.type)}
    record = _access_record(RequestLog(**{"method": "GET", "path": "/", **text_fields}))
    for line in (TextFormatter().format(record), JsonFormatter().format(record)):
        assert "\n" not in line and not UNSAFE.search(line), repr(line)


@settings(max_examples=200, deadline=None)
@given(message=CLIENT_TEXT, argument=CLIENT_TEXT, error=CLIENT_TEXT)
def test_any_logger_message_and_traceback_stay_within_their_record(
    message: str, argument: str, error: str
) -> None:
    """What any logger writes (a uvicorn warning, an exception quoting a client's text): one line for
    the message, and traceback lines indented, so no line can pass for a record of its own."""
    try:
        raise ValueError(error)
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.getLogger("any").makeRecord(
        "any", logging.ERROR, "f", 1, "%s %s", (message, argument), exc_info
    )
    lines = TextFormatter().format(record).split("\n")
    assert not UNSAFE.search("".join(lines)), lines
    assert all(line.startswith("  ") for line in lines[1:]), lines
    assert "\n" not in json.loads(JsonFormatter().format(record))["message"]


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint: Callable[..., Path]) -> Iterator[str]:
    with serve(build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig())) as running:
        yield running.url


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=CLIENT_TEXT)
def test_a_client_chosen_path_is_logged_on_one_escaped_line(
    server_url: str, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvasir.access")
    caplog.clear()
    target = "/" + quote(path.encode("utf-8", "surrogatepass"), safe="")  # the server decodes it back
    httpx.get(server_url + target, timeout=TIMEOUT)
    deadline = time.monotonic() + TIMEOUT  # the line is written just after the last byte is sent
    while not (records := [r for r in caplog.records if r.name == "kvasir.access"]):
        assert time.monotonic() < deadline, "no access line"
        time.sleep(0.01)
    line = TextFormatter().format(records[-1])
    assert "\n" not in line and not UNSAFE.search(line), repr(line)
