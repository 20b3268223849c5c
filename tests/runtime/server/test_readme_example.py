"""The README's first request, sent to the embedded model (SmolLM2-135M-Instruct) as the README shows it."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import httpx
import pytest

from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import TIMEOUT, serve

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_request_and_answer() -> tuple[str, dict[str, object], dict[str, object]]:
    """The path and JSON body of the README's curl command, and the JSON answer shown below it."""
    text = README.read_text(encoding="utf-8")
    curl = re.search(r"curl -s http://localhost:8000(\S+).*?-d '(\{.*?\})'", text, re.S)
    answer = re.search(r"```json\n(\{.*?\})\n```", text, re.S)
    assert curl and answer, "the README no longer shows a curl request and its answer"
    return curl.group(1), json.loads(curl.group(2)), json.loads(answer.group(1))


@pytest.mark.slow
def test_the_readme_request_gets_the_readme_answer() -> None:
    path, body, shown = readme_request_and_answer()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_config = engine_config_from_args(parser.parse_args(["--model", "embedded", "--device", "cpu"]))
    with serve(build_app(engine_config, ServerConfig())) as server:
        response = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert response.status_code == 200
    answer = response.json()
    assert answer["model"] == body["model"] == "SmolLM2-135M-Instruct"
    content = answer["choices"][0]["message"]["content"]
    assert "Paris" in content
    # Greedy decoding: the answer is the one the README shows, token for token.
    assert answer["choices"] == shown["choices"]
    assert answer["usage"] == shown["usage"]
