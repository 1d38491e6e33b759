"""The HA tests start their own Redis processes (tests/redis_ha/servers.py); none uses :6379."""

from __future__ import annotations

import pytest

from tests.redis_ha.servers import MISSING, REDIS_CLI, REDIS_SERVER


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        skip = pytest.mark.skip(reason=MISSING)
        for item in items:
            if "tests/redis_ha/" in str(item.fspath):
                item.add_marker(skip)
