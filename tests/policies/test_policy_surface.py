"""The public surface is small and pinned; policies/ imports only the stdlib and itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import policies

PACKAGE = Path(policies.__file__).parent


def test_exported_members() -> None:
    assert sorted(policies.__all__) == sorted(
        [
            "POLICY_NAMES",
            "Decision",
            "Filter",
            "Learner",
            "Outcome",
            "Picker",
            "Policy",
            "PolicyConfigError",
            "ReplicaView",
            "RoutedRequest",
            "Scorer",
            "build_policy",
        ]
    )
    for name in policies.__all__:
        assert hasattr(policies, name)


def test_policies_import_only_stdlib_and_themselves() -> None:
    allowed = set(sys.stdlib_module_names) | {"policies", "__future__"}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{path.relative_to(PACKAGE)} imports {roots}"
