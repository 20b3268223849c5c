"""The operator's subcommands of `kvasir`: `render` (dry run) and `operator` (run the controller).

Nothing here imports kopf at module level: `kvasir --help` and `kvasir render` never pay for it."""

from __future__ import annotations

import argparse
import math
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
        "operator would create, as multi-document YAML, for dry runs and GitOps. Each LLMDeployment is "
        "checked as the API server and the operator would check it (unknown fields are errors); "
        "objects of other kinds are passed over. Exit status 2 when an input is unusable or holds no "
        "LLMDeployment.",
    )
    render.add_argument(
        "-f",
        "--filename",
        required=True,
        action="extend",
        nargs="+",
        metavar="FILE",
        help="YAML or JSON file, directory (its .yaml, .yml and .json files), glob, or '-' for stdin; "
        "repeatable, and several may follow one -f",
    )
    render.add_argument("-R", "--recursive", action="store_true", help="read directories' subdirectories too")
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
    operator.add_argument("--http-port", type=_port, default=8080, help="port of /healthz and /metrics")
    operator.add_argument("--resync-seconds", type=_positive, default=300.0, help="periodic drift check")
    operator.add_argument(
        "--prometheus-url",
        default=os.environ.get("KVASIR_PROMETHEUS_URL"),
        help="read the autoscaler's pod metrics from this Prometheus instead of each pod's /metrics",
    )
    operator.add_argument(
        "--scrape-timeout",
        type=_positive,
        default=2.0,
        help="seconds the autoscaler waits for one pod's /metrics (default: 2)",
    )
    operator.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    operator.set_defaults(handler=_operator)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _render(args: argparse.Namespace) -> int:
    from kvasir.operator.render import Rendered, dump_manifests, render_documents
    from kvasir.operator.render_files import expand, read_documents
    from kvasir.operator.yaml_input import InputError

    try:
        names = expand(args.filename, recursive=args.recursive)
    except InputError as exc:
        print(f"kvasir render: {exc}", file=sys.stderr)
        return 2
    rendered = Rendered()
    failed = False
    shown = {name: "<stdin>" if name == "-" else name for name in names}
    for name in names:  # every input is checked, and each unusable one reported, before any output
        try:
            documents = read_documents(name)
            render_documents(
                documents, namespace=args.namespace, with_service_monitor=args.service_monitor, into=rendered
            )
        except InputError as exc:
            print(f"kvasir render: {shown[name]}: {exc}", file=sys.stderr)
            failed = True
    if failed:
        return 2
    if not rendered.manifests:
        inputs = ", ".join(shown[name] for name in names[:3])
        inputs += f" and {len(names) - 3} more" if len(names) > 3 else ""
        found = f" (found {', '.join(rendered.skipped[:5])})" if rendered.skipped else ""
        print(f"kvasir render: {inputs}: no LLMDeployment to render{found}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_manifests(rendered.manifests))
    return 0


def _operator(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvasir.operator.handlers import HandlerConfig, default_login
    from kvasir.operator.leader import LeaseConfig
    from kvasir.operator.runner import (
        LeadershipLost,
        OperatorConfig,
        StartupError,
        namespaces_from,
        run_operator,
    )

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
        asyncio.run(run_operator(config, handle_signals=True))
    except LeadershipLost as exc:
        print(f"kvasir operator: {exc}; exiting so that the pod restarts as a standby", file=sys.stderr)
        return 1
    except StartupError as exc:
        print(f"kvasir operator: {exc}", file=sys.stderr)
        return 2
    return 0
