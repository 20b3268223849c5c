"""The router's settings (`kvasir router` flags), each also a KVASIR_* variable."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvasir.router.lora import parse_aliases
from kvasir.runtime.settings import add_flag, check_settings, config_from_args, flags_of, setting

LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_backends(text: str) -> tuple[str, ...]:
    """`http://A,http://B` -> ("http://A", "http://B"); ValueError naming a bad entry."""
    backends = []
    for raw in text.split(","):
        url = raw.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise ValueError(f"--backends: {raw.strip()!r} is not an http:// or https:// URL")
        backends.append(url)
    if len(set(backends)) != len(backends):
        raise ValueError("--backends lists a backend twice")
    return tuple(backends)


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, where its backends come from and how it scores them.

    Backends are either a static list (`backends`) or the Ready pods of one LLMDeployment
    (`deployment`, in `namespace`), read from the Kubernetes API."""

    host: str = setting("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = setting(8080, type=int, minimum=0, maximum=65535, help="0: any free port")
    backends: tuple[str, ...] | None = setting(
        type=parse_backends,
        help="static backends, comma-separated: http://10.0.0.1:8000,http://10.0.0.2:8000",
    )
    deployment: str | None = setting(
        help="route to the Ready pods of this LLMDeployment (read from the Kubernetes API) instead of --backends"
    )
    namespace: str | None = setting(
        help="the LLMDeployment's namespace (default: the router pod's own namespace)"
    )
    backend_port: int = setting(8000, type=int, minimum=1, maximum=65535, help="the pods' serving port")
    scrape_interval: float = setting(
        1.0, type=float, minimum=0.05, maximum=60, help="seconds between scrapes of each backend's /metrics"
    )
    scrape_timeout: float = setting(
        0.5, type=float, minimum=0.01, maximum=30, help="a /metrics answer slower than this counts as none"
    )
    discovery_interval: float = setting(
        2.0, type=float, minimum=0.1, maximum=300, help="seconds between listings of the deployment's pods"
    )
    connect_timeout: float = setting(
        2.0, type=float, minimum=0.01, maximum=60, help="seconds to open a connection to a backend"
    )
    first_byte_timeout: float = setting(
        600.0,
        type=float,
        minimum=0.1,
        maximum=86400,
        help="seconds a backend may take to start its answer (a non-streamed answer starts when it is "
        "complete); past it the request is retried elsewhere, or answered 504",
    )
    api_key: str | None = setting(
        help="require `Authorization: Bearer KEY` on the proxied routes, checked before the body is "
        "read (also KVASIR_API_KEY; unset: the router checks none); the header still goes to the backend"
    )
    backend_api_key: str | None = setting(
        help="sent as `Authorization: Bearer KEY` on the router's own reads of a backend's /v1/models "
        "(which adapters it serves), for backends behind --api-key (also KVASIR_BACKEND_API_KEY; "
        "unset: those reads carry no key and such backends' lists go unread)"
    )
    max_request_bytes: int = setting(
        32 << 20,
        type=int,
        minimum=1,
        help="larger request bodies are refused with 413 before they are parsed (as kvasir serve)",
    )
    max_buffered_request_bytes: int = setting(
        256 << 20,
        type=int,
        minimum=1,
        help="request bodies held at once, all requests together; past it, 429 with Retry-After",
    )
    scrape_max_bytes: int = setting(
        1 << 20,
        type=int,
        minimum=1024,
        help="a backend's /metrics page larger than this counts as no answer (unknown metrics)",
    )
    max_attempts: int = setting(
        3,
        type=int,
        minimum=1,
        maximum=16,
        help="backends tried for one request when they answer 429/503 or cannot be reached",
    )
    # llm-d's endpoint picker weighs queue 2, KV cache 2, prefix 3; the same defaults here.
    prefix_weight: float = setting(3.0, type=float, minimum=0, maximum=100, help="weight of prefix affinity")
    queue_weight: float = setting(2.0, type=float, minimum=0, maximum=100, help="weight of the queue score")
    kv_weight: float = setting(2.0, type=float, minimum=0, maximum=100, help="weight of free KV cache")
    lora_weight: float = setting(
        2.0,
        type=float,
        minimum=0,
        maximum=100,
        help="weight of LoRA affinity: the adapter running or waiting on a backend, or a free slot",
    )
    lora_aliases: dict[str, tuple[tuple[str, int], ...]] | None = setting(
        type=parse_aliases,
        help='weighted LoRA aliases as JSON, {"support": {"support-v2": 90, "support-v1": 10}}: a '
        "request for an alias goes out as a request for one adapter, drawn by weight",
    )
    prefix_block_chars: int = setting(
        64,
        type=int,
        minimum=8,
        maximum=4096,
        help="characters per prefix block the router hashes (about 16 tokens of English)",
    )
    prefix_cache_blocks: int = setting(
        200_000,
        type=int,
        minimum=1,
        help="prefix blocks remembered per backend (least recently routed forgotten first)",
    )
    balance_ratio: float = setting(
        1.5,
        type=float,
        minimum=1.0,
        maximum=100,
        help="a backend with more than this times the least loaded one's requests (and "
        "--balance-slack more) loses its prefix preference",
    )
    balance_slack: int = setting(
        4, type=int, minimum=0, help="requests of imbalance always tolerated for prefix affinity"
    )
    drain_timeout: float = setting(
        30.0,
        type=float,
        minimum=0,
        maximum=3600,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    # Scale from zero: a model at zero replicas takes minutes to come back (a pod scheduled, an
    # image pulled, weights loaded), so a request is held that long rather than the 20 s of
    # KEDA's HTTP add-on; an SDK's read timeout (the openai client's is 600 s) is longer still.
    hold_timeout: float = setting(
        300.0,
        type=float,
        minimum=0.1,
        maximum=3600,
        help="seconds a request may wait for a first ready backend (scale from zero); then 503",
    )
    max_held_requests: int = setting(
        100,
        type=int,
        minimum=0,
        maximum=100_000,
        help="requests held at once while no backend is ready (their bodies count in "
        "--max-buffered-request-bytes); past it, 503 at once; 0: no holding, 503 at once",
    )
    heartbeat_interval: float = setting(
        5.0,
        type=float,
        minimum=0.1,
        maximum=10,
        help="seconds between SSE comments (`: heartbeat`) on a held stream, so that proxies' and "
        "clients' read timeouts do not fire while a backend starts",
    )
    log_level: str = setting("info", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        check_settings(self)
        if (self.backends is None) == (self.deployment is None):
            raise ValueError(
                "give exactly one of --backends (a static list) and --deployment (pods from Kubernetes)"
            )
        if self.backends is not None and not self.backends:
            raise ValueError("--backends lists no backend")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty (leave it unset to check no key)")
        if self.backend_api_key == "":
            raise ValueError("--backend-api-key must not be empty (leave it unset to send no key)")


ROUTER_FLAGS = flags_of(RouterConfig)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("router (each also readable from KVASIR_<FLAG>)")
    for flag in ROUTER_FLAGS:
        add_flag(group, flag)


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Build the RouterConfig; raises ValueError naming the bad value."""
    return config_from_args(RouterConfig, args)
