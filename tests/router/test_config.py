"""`kvasir router`'s settings: bad values are refused with the flag's name."""

from __future__ import annotations

import pytest

from kvasir.cli import build_parser
from kvasir.router.config import RouterConfig, parse_backends, router_config_from_args


def test_backends_parse_and_bad_ones_are_named() -> None:
    assert parse_backends("http://a:1, http://b:2/") == ("http://a:1", "http://b:2")
    with pytest.raises(ValueError, match="'ftp://a' is not an http"):
        parse_backends("http://a,ftp://a")
    with pytest.raises(ValueError, match="twice"):
        parse_backends("http://a,http://a")


def test_exactly_one_source_of_backends() -> None:
    with pytest.raises(ValueError, match="exactly one of --backends"):
        RouterConfig()
    with pytest.raises(ValueError, match="exactly one of --backends"):
        RouterConfig(backends=("http://a",), deployment="d")
    assert RouterConfig(deployment="d").deployment == "d"


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_SCRAPE_INTERVAL", "0.5")
    args = build_parser().parse_args(
        ["router", "--backends", "http://a:8000,http://b:8000", "--port", "9000"]
    )
    config = router_config_from_args(args)
    assert config.backends == ("http://a:8000", "http://b:8000")
    assert (config.port, config.scrape_interval) == (9000, 0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--backends", "http://a", "--max-attempts", "0"])


def test_the_router_listens_on_loopback_unless_told_otherwise() -> None:
    """No API key by default, so not every interface by default (as `kvasir serve`); the operator
    gives the router's pod `--host 0.0.0.0`."""
    args = build_parser().parse_args(["router", "--backends", "http://a:8000"])
    assert router_config_from_args(args).host == "127.0.0.1"
    args = build_parser().parse_args(["router", "--backends", "http://a:8000", "--host", "0.0.0.0"])
    assert router_config_from_args(args).host == "0.0.0.0"


def test_the_hold_flags_their_defaults_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scale from zero: minutes of hold by default (an LLM's cold start), a heartbeat within 10 s."""
    config = RouterConfig(backends=("http://a",))
    assert (config.hold_timeout, config.max_held_requests, config.heartbeat_interval) == (300.0, 100, 5.0)
    monkeypatch.setenv("KVASIR_MAX_HELD_REQUESTS", "10")
    args = build_parser().parse_args(["router", "--backends", "http://a", "--hold-timeout", "3"])
    config = router_config_from_args(args)
    assert (config.hold_timeout, config.max_held_requests) == (3.0, 10)
    assert RouterConfig(backends=("http://a",), max_held_requests=0).max_held_requests == 0  # holding off
    for flag, value in (
        ("--heartbeat-interval", "11"),
        ("--max-held-requests", "-1"),
        ("--hold-timeout", "0"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["router", "--backends", "http://a", flag, value])
