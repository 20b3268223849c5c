"""The layer rules of docs/architecture.md, checked on the import graph of the source (every
`import` and `from ... import` statement, at any depth of a module, type-only ones included).

Inside `kvasir.runtime`, layers call downward only: server -> engine -> (core, worker ->
spec_decode -> (sample, models -> layers -> kernels)). What crosses a boundary is a small record
from a hand-off module both sides may import; nothing else of another layer is imported against
the arrow. Speculative decoding is one layer: the engine asks it for drafts, the worker runs its
drafter and verification, the server exports its counters; it reads the scheduler's requests and
the model runner through protocols of its own, never their modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "runtime"

# Records and settings every layer may read: the boundaries' hand-off modules.
HAND_OFF = {
    "kvasir.runtime.outputs",
    "kvasir.runtime.config",
    "kvasir.runtime.settings",
    "kvasir.runtime.engine.outputs",  # server <- engine
    "kvasir.runtime.core.scheduler_output",  # engine/core -> worker, sample
    "kvasir.runtime.sample.params",  # request parameters: server, core and the sampler
    "kvasir.runtime.spec_decode.config",  # the speculative-decoding setting, parsed with the others
    "kvasir.runtime.structured.params",  # a request's grammar: server, sampling parameters, engine
    "kvasir.runtime.structured.limits",  # the grammar compile bounds, parsed with the other settings
    "kvasir.runtime.lora.params",  # which adapter a request runs with: server, engine, core, worker
}
# What each layer of the runtime must not import (beyond the hand-off modules).
FORBIDDEN = {
    "server": {"core", "worker", "sample", "models", "layers"},
    "engine": {"server"},
    "core": {"server", "engine", "worker", "sample", "models", "layers", "loader", "spec_decode"},
    "worker": {"server", "engine", "core"},
    "spec_decode": {"server", "engine", "core", "worker", "loader"},
    "sample": {"server", "engine", "core", "worker", "models", "layers", "loader", "spec_decode"},
    "models": {"server", "engine", "core", "worker", "sample", "spec_decode"},
    "layers": {"server", "engine", "core", "worker", "sample", "models", "loader", "spec_decode"},
    "loader": {"server", "engine", "core", "worker", "sample", "spec_decode"},
    # Grammars and tool calls: plain data and the grammar engine, read by the layers above them.
    "structured": {
        "server",
        "engine",
        "core",
        "worker",
        "sample",
        "models",
        "layers",
        "spec_decode",
        "tools",
    },
    "tools": {"server", "engine", "core", "worker", "sample", "models", "layers", "spec_decode"},
}
# Tensor parallelism's rank record and collectives sit below every layer that calls them (the
# LoRA hand-off package included).
FORBIDDEN["parallel"] = {*FORBIDDEN, "lora"}
# Leaf modules at the runtime's top level (settings, records) import no layer at all. (The flag
# table `engine_args` and the CLI sit above every layer.)
LEAVES = {"config", "settings", "outputs", "threads", "allocator", "startup_phases"}
LAYERS = set(FORBIDDEN)


def _module(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvasir", "runtime", *parts])


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvasir", "runtime"] else None


def _graph() -> dict[str, set[str]]:
    return {_module(path): _imports(path) for path in sorted(RUNTIME.rglob("*.py"))}


def _violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in sorted(graph.items()):
        layer = _layer(source)
        for target in sorted(targets):
            if target in HAND_OFF or any(target.startswith(f"{h}.") for h in HAND_OFF):
                continue
            other = _layer(target)
            if other is None or other == layer:
                continue
            if layer in FORBIDDEN and other in FORBIDDEN[layer]:
                found.append(f"{source} -> {target}")
            elif layer in LEAVES and other in LAYERS:
                found.append(f"{source} (a leaf) -> {target}")
    return found


def test_the_runtime_layers_import_downward_only() -> None:
    assert _violations(_graph()) == []


def test_the_check_catches_the_imports_it_once_found() -> None:
    graph = {
        "kvasir.runtime.server.runner": {"kvasir.runtime.worker.threads"},
        "kvasir.runtime.server.metrics": {"kvasir.runtime.core.spec_stats"},
        "kvasir.runtime.config": {"kvasir.runtime.core.request_queue"},
        "kvasir.runtime.sample.metadata": {"kvasir.runtime.core.request"},
        # (the worker's call into speculative decoding's verification is allowed)
        "kvasir.runtime.worker.model_runner": {
            "kvasir.runtime.core.scheduler",
            "kvasir.runtime.spec_decode.verification",
        },
        # speculative decoding reaching up for what its protocols describe
        "kvasir.runtime.spec_decode.proposer": {
            "kvasir.runtime.core.request",
            "kvasir.runtime.worker.model_runner",
        },
        # allowed: a hand-off module, and a layer calling downward
        "kvasir.runtime.worker.block_table": {"kvasir.runtime.core.scheduler_output"},
        "kvasir.runtime.engine.llm_engine": {"kvasir.runtime.worker.model_runner"},
        "kvasir.runtime.spec_decode.verification": {"kvasir.runtime.core.scheduler_output"},
    }
    assert _violations(graph) == [
        "kvasir.runtime.config (a leaf) -> kvasir.runtime.core.request_queue",
        "kvasir.runtime.sample.metadata -> kvasir.runtime.core.request",
        "kvasir.runtime.server.metrics -> kvasir.runtime.core.spec_stats",
        "kvasir.runtime.server.runner -> kvasir.runtime.worker.threads",
        "kvasir.runtime.spec_decode.proposer -> kvasir.runtime.core.request",
        "kvasir.runtime.spec_decode.proposer -> kvasir.runtime.worker.model_runner",
        "kvasir.runtime.worker.model_runner -> kvasir.runtime.core.scheduler",
    ]


# ---- kvasir.router: its own layer beside the runtime and the operator ------------------------------
ROUTER = REPO / "router"
# What the router may use of the other packages: torch-free pieces only (its image has no torch).
ROUTER_MAY_IMPORT = {
    "kvasir.observability.metric_names",
    "kvasir.runtime.settings",  # the flag table
    "kvasir.runtime.server.draining",  # the SIGTERM drain `kvasir serve` uses
    "kvasir.runtime.server.http_protocol",  # the same HTTP/1.1 limits as `kvasir serve`
    # The same body limits as `kvasir serve`: one body's cap and all bodies' bound (torch- and
    # FastAPI-free), and the JSON shape bounds on the raw bytes (`json_bounds`: the torch-free walk
    # that the server's `json_shape` wraps in its own error type).
    "kvasir.runtime.server.body_limit",
    "kvasir.runtime.server.json_bounds",
    "kvasir.runtime.server.printable",  # client text made safe for a log line or an error message
    "kvasir.operator.naming",  # the pods' selector labels
    "kvasir.operator.autoscaler.metrics",  # the /metrics parser (Kvasir's and vLLM's names)
    "kvasir.operator.autoscaler.pods",  # a pod's readiness, as the autoscaler reads it
}


def _router_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if not target.startswith("kvasir.") or target.startswith("kvasir.router"):
                continue
            if not any(
                target == allowed or target.startswith(f"{allowed}.") for allowed in ROUTER_MAY_IMPORT
            ):
                # `from kvasir.operator.autoscaler.metrics import parse_metrics` also names the package.
                if any(allowed.startswith(f"{target}.") for allowed in ROUTER_MAY_IMPORT):
                    continue
                found.append(f"{source} -> {target}")
    return found


def test_the_router_imports_only_its_allowed_pieces() -> None:
    graph = {"kvasir.router." + path.stem: _imports(path) for path in sorted(ROUTER.rglob("*.py"))}
    assert _router_violations(graph) == []
    assert _router_violations({"kvasir.router.x": {"kvasir.runtime.engine.llm_engine"}}) == [
        "kvasir.router.x -> kvasir.runtime.engine.llm_engine"
    ]


# The simulator routes with the router's pure scorer and prefix index, as it runs the operator's
# pure decide(); nothing else of the router, and no other package, imports it.
SIMULATOR_MAY_IMPORT = ("kvasir.router.scorer", "kvasir.router.prefix")


def test_no_other_package_imports_the_router() -> None:
    for folder in ("runtime", "operator", "simulator", "observability", "kernels"):
        allowed = SIMULATOR_MAY_IMPORT if folder == "simulator" else ()
        for path in (REPO / folder).rglob("*.py"):
            for name in _imports(path):
                if name.startswith("kvasir.router") and not any(
                    name == a or name.startswith(f"{a}.") for a in allowed
                ):
                    raise AssertionError(f"{path} imports {name}")


def test_the_router_loads_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvasir.router.server, kvasir.router.cli; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
