"""The import direction and the public surfaces, pinned: lower floors never import higher ones, and
what the wheel ships (gateway, prefix_index, policies, simulator) never imports bench or tests."""

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
