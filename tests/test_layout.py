"""The import direction and the public surfaces, pinned: lower floors never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"gateway", "prefix_index", "policies", "simulator", "bench"}
ALLOWED = {
    "prefix_index": set(),
    "policies": set(),
    "simulator": set(),
    "gateway": {"prefix_index", "policies", "simulator"},  # simulator: `gateway demo` only
}


def imported_packages(pkg: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / pkg).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.update(n.split(".")[0] for n in names if n.split(".")[0] in PROJECT)
    return found - {pkg}


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_import_direction(pkg: str) -> None:
    extra = imported_packages(pkg) - ALLOWED[pkg]
    assert not extra, f"{pkg} must not import {sorted(extra)}"


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
