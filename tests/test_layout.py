"""The import direction and the public surfaces, pinned: lower floors never import higher ones, and
what the wheel ships (gateway, prefix_index, policies, simulator) never imports bench or tests.

Inside gateway/, its folders (and its top-level files) are floors: each imports only floors below
it, counting every import (a function's, one under TYPE_CHECKING), so no change in a floor can
reach one below it (docs/architecture.md "The layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"gateway", "prefix_index", "policies", "simulator", "bench", "tests"}
ALLOWED = {
    "prefix_index": set(),
    "policies": set(),
    "simulator": set(),
    "gateway": {"prefix_index", "policies"},  # `gateway plan` loads simulator.plan by name
}
# modules allowed more than their package: `gateway demo` composes the gateway and the simulator;
# the simulator renders chat templates with prefix_index.templates (the one copy of vLLM's
# rendering, held to real vLLM by tests/engine)
EXCEPTIONS = {
    "gateway/demo.py": {"simulator"},
    "simulator/tokenizer.py": {"prefix_index"},
    "simulator/responses.py": {"prefix_index"},
}


# gateway/'s floors, bottom to top: a folder or a top-level file imports only those of lower rows
# (or itself); the names on one row do not import each other
FLOORS: list[tuple[str, ...]] = [
    ("errors.py", "types.py", "version.py"),  # shared words
    ("telemetry",),  # a sink: metrics, logs, traces, the receipt
    ("api",),  # the OpenAI API's shapes
    ("transport",),  # HTTP/1.1 on the wire, both ways
    ("limits",),  # tenants, rate limits, admission, budgets
    ("config",),  # routes.yaml's model, composed of the sections the floors below define
    ("fleet",),  # replicas, pools, scrapes, KV events, discovery, shared load, LoRA state
    ("routing",),  # decides: Router.choose; no I/O
    ("forwarding",),  # sends: failover, P/D, the relay, LoRA loading
    ("runtime",),  # Gateway, the snapshot, background work, reload
    ("pipeline",),  # the request's steps and its Record
    ("http",),  # the app, the endpoint, OpenAPI, status
    ("demo.py",),
    ("cli.py", "__init__.py"),
    ("__main__.py",),
]
FLOOR = {name: i for i, row in enumerate(FLOORS) for name in row}


def gateway_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a gateway module in `path`, wherever it stands."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import (write it whole)"
            if node.module == "gateway":
                found += [(node.lineno, f"gateway.{a.name}") for a in node.names]
            elif node.module:
                found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m.split(".")[0] == "gateway"]


def unit_of(module: str) -> str | None:
    """The floor's name (a folder of gateway/, or a top-level file) that holds `module`; None
    for the package itself or a name it hands on (`from gateway import Config`)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if (ROOT / "gateway" / parts[1]).is_dir():
        return parts[1]
    file = parts[1] + ".py"
    return file if (ROOT / "gateway" / file).is_file() else None


def test_every_part_of_gateway_stands_on_a_floor() -> None:
    parts = {
        p.name
        for p in (ROOT / "gateway").iterdir()
        if (p.is_dir() and any(p.rglob("*.py"))) or p.suffix == ".py"
    }
    assert parts == set(FLOOR), (
        f"on no floor: {sorted(parts - set(FLOOR))}; gone: {sorted(set(FLOOR) - parts)}"
    )


def test_gateway_floors_import_only_below() -> None:
    upward = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        rel = path.relative_to(ROOT / "gateway")
        mine = rel.parts[0]
        for line, module in gateway_imports(path):
            theirs = unit_of(module)
            if theirs is None or theirs == mine:
                continue
            if FLOOR[theirs] >= FLOOR[mine]:
                upward.append(
                    f"gateway/{rel.as_posix()}:{line} imports {module} ({theirs} is not below {mine})"
                )
    assert not upward, "imports that run up a floor or across one:\n" + "\n".join(upward)


def imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in PROJECT)
    return found


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_import_direction(pkg: str) -> None:
    for path in sorted((ROOT / pkg).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        allowed = ALLOWED[pkg] | EXCEPTIONS.get(name, set()) | {pkg}
        extra = imported_packages(path) - allowed
        assert not extra, f"{name} must not import {sorted(extra)}"


def test_exceptions_are_live() -> None:
    for name, extra in EXCEPTIONS.items():
        assert extra <= imported_packages(ROOT / name), f"{name} no longer needs its exception"


def test_public_surfaces() -> None:
    import gateway
    import policies
    import prefix_index

    assert set(gateway.__all__) == {
        "Config",
        "ConfigError",
        "create_app",
        "load_config",
        "parse_config",
    }
    assert {"Policy", "build_policy", "PolicyConfigError", "RoutedRequest", "ReplicaView"} <= set(
        policies.__all__
    )
    assert {"PrefixIndex", "open_index"} <= set(prefix_index.__all__)
