"""Routing policies: filters, scorers in [0, 1] and pickers, composed into a Policy by name.

Usage:

    policy = build_policy("prefix_aware", seed=7)
    decision = policy.choose(request, views)     # decision.ranked[0] is the pick
"""

from policies.base import Filter, Learner, Picker, Policy, Scorer
from policies.errors import PolicyConfigError
from policies.registry import POLICY_NAMES, build_policy
from policies.types import Decision, Outcome, ReplicaView, RoutedRequest

__all__ = [
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
