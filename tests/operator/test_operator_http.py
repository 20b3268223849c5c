"""The operator's own liveness endpoint and Prometheus metrics, served while the real loop runs."""

from __future__ import annotations

import aiohttp
import pytest

pytestmark = pytest.mark.asyncio


async def test_healthz_and_metrics(cluster, start_operator, kt) -> None:
    handle = await start_operator(http_host="127.0.0.1", http_port=0)
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.DEPLOYMENTS, "demo"), what="the Deployment")
    base = f"http://127.0.0.1:{handle.state.http_port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/healthz") as response:
            assert response.status == 200
            assert (await response.text()).strip() == "leading"
        await cluster.wait(
            lambda: handle.metrics.registry.get_sample_value(
                "kvasir_operator_reconciles_total", {"trigger": "create", "result": "ok"}
            ),
            what="a finished reconcile",
        )
        async with session.get(base + "/metrics") as response:
            text = await response.text()
    assert 'kvasir_operator_reconciles_total{result="ok",trigger="create"} 1.0' in text
    assert 'kvasir_operator_child_writes_total{action="created",kind="Deployment"} 1.0' in text
    assert "kvasir_operator_reconcile_duration_seconds_bucket" in text
    assert "kvasir_operator_reconcile_errors_total" in text
    await handle.stop()
    assert handle.state.healthy() == (False, "stopped")
