"""The one exception the policies package raises on purpose: a policy spec that cannot be built.

Hierarchy:

    ValueError
     └── PolicyConfigError   bad preset / plugin name, unknown option, bad weight or guard
"""

from __future__ import annotations


class PolicyConfigError(ValueError):
    """A policy spec is invalid. The message starts with the key path (``policy.scorers.prefx``)."""
