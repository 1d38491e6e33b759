"""The gateway's version, for `gateway --version`, `GET /version` and the OpenAPI document: the
installed distribution's (pyproject.toml's `version`)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["DISTRIBUTION", "gateway_version"]

DISTRIBUTION = "kvgateway"


def gateway_version() -> str:
    """The installed kvgateway's version; `0+unknown` when run from a tree never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"
