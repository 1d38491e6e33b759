"""Every command the README and docs/ give still runs, and every link between the pages lands.

The commands are read from the pages themselves: the lines of ```bash blocks and the inline code
that starts with `gateway `, `python -m ` or `.venv/bin/python -m `. The quick ones run for real
(`gateway check` on a file of this checkout, `gateway plan`, `gateway --version`). The others
(benchmarks of minutes, the simulator's servers) are parsed by their own argument parser, in
this process, and stopped there: a renamed flag, a module that moved or a value of the wrong type
fails here, before an operator copies the line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GATEWAY = Path(sys.executable).parent / "gateway"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`((?:\.venv/bin/)?python -m [a-z_.]+[^`]*|gateway [a-z-][^`]*)`")
# what a command's words may not hold to be run or parsed: a placeholder, an ellipsis, a shell
# construct, a file that only the operator has
UNRUNNABLE = re.compile(r"<|\[|\.\.\.|…|\||&&|\$\(|routes\.yaml\b(?!\.)|\b[A-Z]\b")


def commands() -> Iterator[tuple[str, str]]:
    """(page, command) for every command line of every page."""
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        for lang, block in FENCE.findall(text):
            if lang not in ("bash", "sh", "shell", "console"):
                continue
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    yield name, line
        for m in INLINE.finditer(FENCE.sub("", text)):
            yield name, " ".join(m.group(1).split())


def kind(cmd: str) -> str:
    """run | parse | skip, and why it is skipped in the id."""
    words = cmd.split()
    if UNRUNNABLE.search(cmd) or len(words) < 2:
        return "skip"
    if words[0] == "gateway":  # a subcommand named alone is a mention, not a command
        if words[1:] in (["--version"], ["plan", "-h"], ["demo", "--help"]):
            return "run"
        if len(words) < 3:
            return "skip"
        runs = words[1] in ("check", "plan") and not mention(words[2:])
        return "run" if runs else "parse"
    if words[0].endswith("python") and words[1] == "-m":
        module = words[2] if len(words) > 2 else ""
        if module.split(".")[0] in ("bench", "simulator"):
            return "parse"
    return "skip"


def mention(argv: list[str]) -> bool:
    """Words that name a command without giving it values: a subcommand, bare flags."""
    return all(w.startswith("-") or w.isalpha() for w in argv)


CASES = sorted({cmd: page for page, cmd in sorted(commands(), reverse=True) if kind(cmd) != "skip"}.items())
CASES = [(page, cmd) for cmd, page in CASES]  # each command once, on the first page that gives it


def test_the_pages_give_commands_to_check() -> None:
    runs = [c for c in CASES if kind(c[1]) == "run"]
    parsed = [c for c in CASES if kind(c[1]) == "parse"]
    assert len(runs) >= 3 and len(parsed) >= 20, (runs, parsed)


class Parsed(Exception):
    """Raised by the patched parser once the command's arguments were read."""


@contextlib.contextmanager
def stop_after_parsing() -> Iterator[None]:
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: object, **k: object) -> object:
        real(self, *a, **k)  # type: ignore[arg-type]
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]


@pytest.mark.parametrize(("page", "cmd"), CASES, ids=[f"{p}: {c[:60]}" for p, c in CASES])
def test_a_documented_command_runs(page: str, cmd: str, tmp_path: Path) -> None:
    words = shlex.split(cmd)
    if kind(cmd) == "run":
        got = subprocess.run([str(GATEWAY), *words[1:]], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert got.returncode == 0, (
            f"{page}: `{cmd}` exited {got.returncode}:\n{got.stderr[-2000:]}"
        )
        return
    if words[0] == "gateway":
        module, argv = "gateway.cli", words[1:]
    else:
        module, argv = words[2], words[3:]
    saved = sys.argv
    sys.argv = [module, *argv]
    out = io.StringIO()
    try:
        with stop_after_parsing(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            with warnings.catch_warnings():  # a module another case imported runs again: harmless
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(module, run_name="__main__", alter_sys=False)
    except Parsed:
        return
    except SystemExit as exc:
        if "arguments are required" in out.getvalue() and mention(argv):
            return  # the prose names the command (`gateway plan --pd`); its parser is there
        pytest.fail(
            f"{page}: `{cmd}`: its parser refused it ({exc.code}):\n{out.getvalue()[-2000:]}"
        )
    finally:
        sys.argv = saved
    pytest.fail(f"{page}: `{cmd}` ran to its end without reading its arguments")


# --- every link between the pages lands -----------------------------------------------------------
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.MULTILINE)}


def test_every_link_between_the_pages_lands() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
