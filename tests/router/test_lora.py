"""LoRA in the router: alias weights (a seeded statistical check), the endpoint picker's LoRA
affinity, backends lacking the adapter left out, the LoRA info read from /metrics."""

from __future__ import annotations

import random
import time

import pytest

from kvasir.router.backends import BackendPool
from kvasir.router.config import RouterConfig
from kvasir.router.lora import parse_aliases, read_lora_info, resolve
from kvasir.router.scorer import Candidate, Weights, rank
from tests.router.harness import fleet
from tests.router.stub_backend import TIMEOUT, StubBackend


def test_alias_targets_are_drawn_by_weight() -> None:
    aliases = parse_aliases('{"support": {"support-v2": 90, "support-v1": 10}}')
    rng = random.Random(1234)
    draws = [resolve("support", aliases, rng) for _ in range(20_000)]
    share = draws.count("support-v2") / len(draws)
    # Binomial(20000, 0.9): the standard deviation is 0.2%; 1% is five of them.
    assert abs(share - 0.9) < 0.01
    assert set(draws) == {"support-v1", "support-v2"}
    assert resolve("other", aliases, rng) == "other"


def test_a_zero_weight_target_is_never_drawn() -> None:
    aliases = parse_aliases('{"a": {"x": 100, "y": 0}}')
    rng = random.Random(7)
    assert {resolve("a", aliases, rng) for _ in range(1000)} == {"x"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": {"x": 90, "y": 20}}', "must sum to 100"),
        ('{"a": {"x": 100.0}}', "must be 0..100"),
        ('{"a": {}}', "must map adapters to weights"),
        ("[]", "must be a JSON object"),
    ],
)
def test_bad_aliases_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_aliases(text)


def _backend(
    url: str,
    *,
    adapters: frozenset[str] | None,
    active: frozenset[str] = frozenset(),
    free: bool | None = True,
) -> Candidate:
    return Candidate(
        url,
        load=1.0,
        kv_usage=0.5,
        metrics_known=True,
        adapters=adapters,
        active_adapters=active,
        free_lora_slot=free,
    )


def test_a_backend_lacking_the_adapter_is_never_chosen_when_another_serves_it() -> None:
    has = _backend("http://has", adapters=frozenset({"sql"}), free=False)
    lacks = _backend("http://lacks", adapters=frozenset(), free=True)
    for seed in range(50):
        ranked = rank([lacks, has], {}, 0, Weights(), random.Random(seed), adapter="sql")
        assert [c.url for c in ranked] == ["http://has"]


def test_affinity_prefers_the_adapter_running_then_a_free_slot() -> None:
    running = _backend("http://running", adapters=frozenset({"sql"}), active=frozenset({"sql"}), free=False)
    free = _backend("http://free", adapters=frozenset({"sql"}), active=frozenset({"chat"}), free=True)
    full = _backend("http://full", adapters=frozenset({"sql"}), active=frozenset({"a", "b"}), free=False)
    for seed in range(20):
        ranked = rank([full, free, running], {}, 0, Weights(), random.Random(seed), adapter="sql")
        assert [c.url for c in ranked] == ["http://running", "http://free", "http://full"]


def test_lora_info_is_read_from_kvasir_and_vllm_series() -> None:
    page = (
        "# TYPE kvasir_lora_requests_info gauge\n"
        'kvasir_lora_requests_info{model_name="m",running_lora_adapters="sql,chat",'
        'waiting_lora_adapters="x",max_lora="4"} 1.7e9\n'
    )
    info = read_lora_info(page)
    assert info is not None and info.active == {"sql", "chat", "x"} and info.free_slot
    vllm = 'vllm:lora_requests_info{running_lora_adapters="a,b",waiting_lora_adapters="",max_lora="2"} 5\n'
    info = read_lora_info(vllm)
    assert info is not None and info.active == {"a", "b"} and not info.free_slot
    assert (
        read_lora_info(
            'kvasir_lora_requests_info{running_lora_adapters="",waiting_lora_adapters="",max_lora="0"} 1\n'
        )
        is None
    )


def _adapters_read(router_pool: BackendPool, url: str) -> frozenset[str] | None:
    """The adapters the router read from `url`, once it has scraped it (its metrics known)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        backend = router_pool.backends[url]
        if backend.metrics_known and backend.lora is not None:
            return backend.adapters
        assert time.monotonic() < deadline, "the router never scraped the backend"
        time.sleep(0.02)


def test_adapter_lists_behind_an_api_key_are_read_with_the_backend_key() -> None:
    """A backend behind --api-key answers /v1/models only with its key: the router reads it with
    --backend-api-key; without one the list is unknown (None), never an empty list."""
    with fleet([StubBackend("a", adapters=("sql",), api_key="k1")], backend_api_key="k1") as f:
        assert _adapters_read(f.router.pool, f.backends[0].url) == frozenset({"sql"})
    with fleet([StubBackend("a", adapters=("sql",), api_key="k1")]) as f:
        assert _adapters_read(f.router.pool, f.backends[0].url) is None
        assert all(
            "authorization" not in headers for path, headers in f.stubs[0].seen if path == "/v1/models"
        )


def test_an_empty_backend_key_is_refused() -> None:
    with pytest.raises(ValueError, match="--backend-api-key must not be empty"):
        RouterConfig(backends=("http://a",), backend_api_key="")
