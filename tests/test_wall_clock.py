"""No test asserts that something took less than a fixed number of seconds.

On a busy CI machine any measured duration can stretch, so an upper bound like `elapsed < 2`
flakes. Tests compare two durations measured side by side, or the order of events, instead.
A floor (`elapsed >= delay`) stays allowed: a slow machine only lengthens what it measures,
and a floor is how a test shows that a delay was kept. Timeouts that bound a wait
(`poll_until(..., timeout_s)`, `asyncio.timeout(3)`, a deadline compared with the clock) are
no assertion of speed and are not flagged either.

A duration counts as measured when it derives from a clock reading (`time.monotonic()`,
`time.perf_counter()`, `time.time()`, `loop.time()` and their `_ns` forms) in the same test,
through assignments, lists it was appended to, and the return values of the test modules'
helper functions; or when it is named as one (`elapsed`, `took`, `waited`, `waits`, `duration`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
CLOCKS = frozenset(
    {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
)
DURATION_NAME = re.compile(r"^(elapsed|took|waited|waits|duration)(_s|_ms)?$")
# text a function must hold for the analysis to find anything in it (most hold none of it)
SUSPECT = r"monotonic|perf_counter|time_ns|\.time\(|\b(elapsed|took|waited|waits|duration)"
UPPER = (ast.Lt, ast.LtE)  # left < right: right bounds left from above
LOWER = (ast.Gt, ast.GtE)


def is_clock(node: ast.AST) -> bool:
    """A call that reads a clock: `time.monotonic()`, `loop.time()`, `perf_counter_ns()`..."""
    if not isinstance(node, ast.Call) or node.args or node.keywords:
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in CLOCKS


@dataclass
class Returns:
    """What a helper returns: a measured duration as a whole (`whole`), or per tuple position."""

    whole: bool = False
    positions: set[int] = field(default_factory=set)


class Taint:
    """The names of one function that hold measured durations (or values made from them)."""

    def __init__(self, returns: dict[str, Returns]) -> None:
        self.names: set[str] = set()
        self.returns = returns

    def measured(self, node: ast.AST | None) -> bool:
        if node is None:
            return False
        for sub in ast.walk(node):
            if is_clock(sub):
                return True
            if isinstance(sub, ast.Name) and (sub.id in self.names or DURATION_NAME.match(sub.id)):
                return True
            if isinstance(sub, ast.Call) and (r := self.returns.get(callee(sub))) and r.whole:
                return True
        return False

    def measured_positions(self, value: ast.AST) -> set[int] | None:
        """Positions of a tuple-valued `value` that are measured (None: not a known tuple)."""
        if isinstance(value, ast.Tuple):
            return {i for i, e in enumerate(value.elts) if self.measured(e)}
        if isinstance(value, ast.Await):
            value = value.value
        if isinstance(value, ast.Call) and (r := self.returns.get(callee(value))):
            return set(range(64)) if r.whole else r.positions
        return None

    def bind(self, target: ast.AST, value: ast.AST | None, measured: bool) -> bool:
        """Mark the names `target` binds; True when a name was added."""
        before = len(self.names)
        if isinstance(target, ast.Tuple | ast.List) and value is not None:
            positions = self.measured_positions(value)
            if positions is not None:
                for i, elt in enumerate(target.elts):
                    self.bind(elt, None, i in positions)
                return len(self.names) > before
        if measured:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    self.names.add(sub.id)
        return len(self.names) > before

    def run(self, func: ast.AST) -> None:
        """Propagate through the function's bindings until nothing changes."""
        binds: list[tuple[ast.AST, ast.AST | None, ast.AST]] = []  # (target, value, measured?)
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                binds += [(t, node.value, node.value) for t in node.targets]
            elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                binds.append((node.target, node.value, node.value or node.target))
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                binds.append((node.target, node.iter, node.iter))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert")
            ):  # a list of measured durations
                binds.append((node.func.value, None, ast.Tuple(node.args)))
        changed = True
        while changed:
            changed = False
            for target, value, source in binds:
                changed |= self.bind(target, value, self.measured(source))


def callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def own_returns(func: ast.AST) -> Iterator[ast.Return]:
    """The return statements of `func` itself, not of the functions defined inside it."""
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Return):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def helper_returns(
    tree: ast.Module, source: str, imported: dict[str, Returns]
) -> dict[str, Returns]:
    """The module-level functions of one test module (and the helpers it imports from other
    test modules, `imported`) that return a measured duration, by name."""
    out = dict(imported)
    suspect = re.compile("|".join([SUSPECT, *(rf"\b{re.escape(n)}\(" for n in imported)]))
    lines = source.splitlines()
    top = [
        f for f in tree.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        and suspect.search("\n".join(lines[f.lineno - 1 : f.end_lineno]))
    ]  # fmt: skip
    for _ in range(2):  # a helper that returns what another helper of the module measured
        for func in top:
            taint = Taint(out)
            taint.run(func)
            r = Returns()
            for node in own_returns(func):
                if node.value is None:
                    continue
                if isinstance(node.value, ast.Tuple):
                    r.positions |= {i for i, e in enumerate(node.value.elts) if taint.measured(e)}
                elif taint.measured(node.value):
                    r.whole = True
            if r.whole or r.positions:
                out[func.name] = r
    return out


def imports_from_tests(tree: ast.AST) -> dict[str, tuple[str, str]]:
    """Local name -> (test module, name) for `from tests.x import name [as local]`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "tests":
                for a in node.names:
                    out[a.asname or a.name] = (node.module, a.name)
    return out


def upper_bounds(source: str, returns: dict[str, Returns] | None = None) -> list[int]:
    """Lines of `source` whose assert bounds a measured duration from above by something that
    is not measured (a literal, a constant, a configured value)."""
    tree = ast.parse(source)
    returns = helper_returns(tree, source, {}) if returns is None else returns
    suspect = re.compile("|".join([SUSPECT, *(rf"\b{re.escape(n)}\(" for n in returns)]))
    lines = source.splitlines()
    found: set[int] = set()
    for func in functions(tree):
        if not suspect.search("\n".join(lines[func.lineno - 1 : func.end_lineno])):
            continue
        taint = Taint(returns)
        taint.run(func)
        for node in ast.walk(func):
            if not isinstance(node, ast.Assert):
                continue
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [cmp.left, *cmp.comparators]
                for op, left, right in zip(cmp.ops, sides[:-1], sides[1:], strict=True):
                    lm, rm = taint.measured(left), taint.measured(right)
                    if (
                        (isinstance(op, UPPER) and lm and not rm)
                        or (isinstance(op, LOWER) and rm and not lm)
                        or (isinstance(op, ast.Eq) and lm != rm and approx(left, right))
                    ):
                        found.add(node.lineno)
    return sorted(found)


def approx(*nodes: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and callee(n) == "approx" for n in nodes)


def test_no_test_bounds_a_measured_duration_by_a_fixed_number_of_seconds() -> None:
    sources = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p.read_text()
        for p in sorted(ROOT.rglob("*.py"))
    }
    trees = {name: ast.parse(src) for name, src in sources.items()}
    own = {
        name: helper_returns(trees[name], src, {}) if re.search(SUSPECT, src) else {}
        for name, src in sources.items()
    }
    offences = []
    for name, tree in trees.items():
        imported = {
            local: own[module][attr]
            for local, (module, attr) in imports_from_tests(tree).items()
            if attr in own.get(module, {})
        }
        returns = helper_returns(tree, sources[name], imported) if imported else own[name]
        path = name.replace(".", "/") + ".py"
        offences += [f"{path}:{line}" for line in upper_bounds(sources[name], returns)]
    assert not offences, (
        "these asserts bound a measured duration by a fixed number of seconds (flaky on a busy "
        "machine): compare with a duration measured side by side, or assert an order of events: "
        + ", ".join(offences)
    )


READ = ["async def read():", "    t0 = time.monotonic()", "    return b'', time.monotonic() - t0"]
CASES: list[tuple[list[str], bool]] = [
    (["t0 = time.monotonic()", "work()", "assert time.monotonic() - t0 < 2"], True),
    (["t0 = time.perf_counter()", "took = time.perf_counter() - t0", "assert took < 1.8"], True),
    (["t0 = loop.time()", "await work()", "assert 0.14 <= loop.time() - t0 < 1.0"], True),
    (["t0 = loop.time()", "await work()", "assert 1.0 > loop.time() - t0"], True),
    (["elapsed = stats()['elapsed']", "assert elapsed < LIMIT_S"], True),
    (["stamps = [time.monotonic() - t0 for _ in xs]", "assert stamps[-1] < wall + 1.0"], True),
    (["t = time.monotonic()", "assert f(t) == pytest.approx(1.0, abs=0.2)"], True),
    (["first = None", "first = first or time.monotonic() - t0", "assert first < 1.0"], True),
    (["out, took = await read()", "assert took < 3", *READ], True),
    # a floor: a slow machine cannot break it
    (["t0 = time.monotonic()", "await sleep(0.3)", "assert time.monotonic() - t0 >= 0.25"], False),
    # the position of a tuple that is no duration
    (["out, took = await read()", "assert len(out) < 3", *READ], False),
    # a deadline, a timeout, a bound that grows with the time measured
    (["deadline = time.monotonic() + 10", "assert time.monotonic() < deadline"], False),
    (["async with asyncio.timeout(3):", "    await work()", "assert done"], False),
    (
        ["t0 = time.monotonic()", "n = burst()", "assert n <= 9 + (time.monotonic() - t0) * r"],
        False,
    ),
    # two durations measured side by side
    (
        ["t0 = time.monotonic()", "ta = time.monotonic() - t0", "tb = g(t0)", "assert tb < ta"],
        False,
    ),
]


@pytest.mark.parametrize(("lines", "flagged"), CASES)
def test_what_counts_as_a_fixed_bound(lines: list[str], flagged: bool) -> None:
    source = "async def test():\n" + "".join(f"    {line}\n" for line in lines)
    assert bool(upper_bounds(source)) == flagged, lines
