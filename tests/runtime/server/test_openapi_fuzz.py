"""schemathesis against /openapi.json for the /v1 endpoints: no 5xx, and every 4xx in the OpenAI shape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import TIMEOUT, RunningServer, serve, tiny_engine_config

# Examples per operation and mode: enough to hit every field's edges, small enough for 2 busy cores.
EXAMPLES = 30


def assert_openai_answer(status: int, body: object, description: str) -> None:
    assert status < 500, description
    if status >= 400:
        assert isinstance(body, dict) and set(body) == {"error"}, description
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, description
        assert isinstance(error["message"], str) and error["message"], description
        assert isinstance(error["type"], str), description


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[RunningServer]:
    # A short context bounds the work of every generated request.
    engine_config = tiny_engine_config(tiny_checkpoint("llama"), max_model_len=32, max_num_seqs=8)
    with serve(build_app(engine_config, ServerConfig(max_queue_len=8))) as running:
        yield running


def test_v1_endpoints_never_answer_5xx(server: RunningServer) -> None:
    raw = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    schema = schemathesis.openapi.from_dict(raw).include(path_regex="^/v1/")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @hypothesis.settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,  # the same cases on every run: a failure reproduces
                suppress_health_check=list(hypothesis.HealthCheck),
                phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                response = case.call(base_url=server.url, timeout=TIMEOUT)
                body = response.json() if response.status_code >= 400 else None
                assert_openai_answer(response.status_code, body, case.as_curl_command())

            check()
    # Whatever the fuzzer sent, the engine is still healthy and nothing is left running.
    server.wait_idle()
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    stats = server.state.metrics.registry.get_sample_value(
        "kvasir_requests_running", {"model_name": server.state.model_name}
    )
    assert stats == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 10_000}, "n"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_completion_fields_name_their_param(
    body: dict[str, object], param: str, server: RunningServer
) -> None:
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 400
    assert_openai_answer(400, response.json(), str(body))
    assert response.json()["error"]["param"] == param
