"""The 3x3 solve behind the TTFT scorer's ridge fits (its prefill fit and its tier rates)."""

from __future__ import annotations


def solve3(m: list[float], v: list[float]) -> tuple[float, float, float] | None:
    """Solve the symmetric 3x3 system m x = v (m as upper triangle 00 01 02 11 12 22); None
    when it is singular."""
    a, b, c, d, e, f = m
    # cofactors of the symmetric matrix [[a b c] [b d e] [c e f]]
    c00, c01, c02 = d * f - e * e, c * e - b * f, b * e - c * d
    det = a * c00 + b * c01 + c * c02
    if abs(det) < 1e-12:
        return None
    c11, c12, c22 = a * f - c * c, b * c - a * e, a * d - b * b
    x0 = (c00 * v[0] + c01 * v[1] + c02 * v[2]) / det
    x1 = (c01 * v[0] + c11 * v[1] + c12 * v[2]) / det
    x2 = (c02 * v[0] + c12 * v[1] + c22 * v[2]) / det
    return x0, x1, x2
