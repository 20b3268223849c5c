"""The operator's subcommands of `kvasir`: `render` (dry run) and `operator` (run the controller).

Nothing here imports kopf at module level: `kvasir --help` and `kvasir render` never pay for it."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add `render` and `operator` to the top-level `kvasir` parser."""
    render = subparsers.add_parser(
        "render",
        help="print the manifests the operator would create for an LLMDeployment",
        description="Print the Deployment, Service, PodDisruptionBudget (and ServiceMonitor) that the "
        "operator would create, as multi-document YAML, for dry runs and GitOps.",
    )
    render.add_argument(
        "-f", "--filename", required=True, action="append", help="LLMDeployment YAML ('-': stdin)"
    )
    render.add_argument("-n", "--namespace", help="namespace for objects that name none (default: 'default')")
    render.add_argument(
        "--service-monitor",
        action="store_true",
        help="also render the ServiceMonitor (monitoring.coreos.com)",
    )
    render.set_defaults(handler=_render)

    operator = subparsers.add_parser(
        "operator",
        help="run the LLMDeployment operator",
        description="Reconcile LLMDeployments into Deployments, Services, PDBs and ServiceMonitors.",
    )
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    operator.add_argument(
        "--no-leader-election", action="store_true", help="act without holding the Lease (one replica only!)"
    )
    operator.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "kvasir-system"),
        help="namespace of the leader Lease (default: $POD_NAMESPACE or kvasir-system)",
    )
    operator.add_argument("--lease-name", default="kvasir-operator", help="name of the leader Lease")
    operator.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name in the leader Lease (default: $POD_NAME, else the host name)",
    )
    operator.add_argument(
        "--http-host", default="0.0.0.0", help="address /healthz and /metrics listen on (default: all)"
    )
    operator.add_argument("--http-port", type=int, default=8080, help="port of /healthz and /metrics")
    operator.add_argument("--resync-seconds", type=float, default=300.0, help="periodic drift check")
    operator.add_argument(
        "--prometheus-url",
        default=os.environ.get("KVASIR_PROMETHEUS_URL"),
        help="read the autoscaler's pod metrics from this Prometheus instead of each pod's /metrics",
    )
    operator.add_argument(
        "--scrape-timeout",
        type=float,
        default=2.0,
        help="seconds the autoscaler waits for one pod's /metrics (default: 2)",
    )
    operator.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    operator.set_defaults(handler=_operator)


def _render(args: argparse.Namespace) -> int:
    from kvasir.operator.render import render_yaml
    from kvasir.operator.source import SpecError

    out = []
    for filename in args.filename:
        try:
            if filename == "-":
                text = sys.stdin.read()
            else:
                with open(filename, encoding="utf-8") as handle:
                    text = handle.read()
            out.append(render_yaml(text, namespace=args.namespace, with_service_monitor=args.service_monitor))
        except (OSError, SpecError) as exc:
            print(f"kvasir render: {filename}: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write("".join(out))
    return 0


def _operator(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvasir.operator.handlers import HandlerConfig, default_login
    from kvasir.operator.leader import LeaseConfig
    from kvasir.operator.runner import LeadershipLost, OperatorConfig, namespaces_from, run_operator

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    leader = None
    if not args.no_leader_election:
        leader = LeaseConfig(namespace=args.lease_namespace, identity=args.identity, name=args.lease_name)
    config = OperatorConfig(
        handlers=HandlerConfig(login=default_login, resync_seconds=args.resync_seconds),
        namespaces=namespaces_from(args.namespace),
        leader=leader,
        http_host=args.http_host,
        http_port=args.http_port,
        prometheus_url=args.prometheus_url,
        scrape_timeout_seconds=args.scrape_timeout,
    )
    try:
        asyncio.run(run_operator(config))
    except LeadershipLost as exc:
        print(f"kvasir operator: {exc}; exiting so that the pod restarts as a standby", file=sys.stderr)
        return 1
    return 0
