"""The operator runs as a uid with no passwd entry (the chart's image runs as 65532 and has none):
kopf's default identity comes from getpass.getuser(), which raises KeyError for such a uid, and
the operator crashed at start on a real kubelet. It names kopf's identity itself now."""

from __future__ import annotations

import getpass

import pytest

pytestmark = pytest.mark.asyncio


async def test_the_operator_reconciles_as_a_user_without_a_name(
    cluster, start_operator, kt, monkeypatch
) -> None:
    def no_passwd_entry() -> str:
        raise KeyError("getpwuid(): uid not found: 65532")

    monkeypatch.setattr(getpass, "getuser", no_passwd_entry)
    await start_operator()
    await cluster.create(kt.LLMD, kt.llmd("demo"))
    await cluster.wait(lambda: cluster.get(kt.CHILDREN[0], "demo"), what="the first child of demo")
