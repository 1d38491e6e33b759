"""What a deployment installs: the wheel's packages, and the gateway serving a request with only the
declared runtime dependencies importable.

The wheel is built from a copy of the tree (nothing written into the checkout), offline: the venv's
own setuptools, no build isolation. The runtime check runs the gateway in `python -I` behind an
import hook that refuses every top-level module other than the standard library, the wheel's
packages and the declared dependencies (with what they require in turn), as a clean venv would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"gateway", "prefix_index", "policies", "simulator"}
NEVER_SHIPPED = {"bench", "tests", "scripts"}


def _project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def test_wheel_ships_the_runtime_packages_and_no_bench(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in sorted(SHIPPED | NEVER_SHIPPED):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("kvgateway-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if "/" in n and ".dist-info/" not in n}
    assert tops == SHIPPED, f"the wheel ships {sorted(tops)}"
    assert "gateway/demo.py" in names and "simulator/fleet.py" in names
    # the demo is the gateway's; the test and bench harness and the simulator's calibration,
    # fidelity and report tools are the dev side's (bench/)
    dev = {"demo", "harness", "calibrate", "fidelity", "report"}
    assert not {f"simulator/{m}.py" for m in dev} & set(names)
    assert any(n.startswith("gateway/static/") for n in names)  # the dashboard
    assert any(n.startswith("simulator/profiles/") and n.endswith(".yaml") for n in names)


def _import_names(dist: metadata.Distribution) -> set[str]:
    """The top-level modules a distribution installs (from its RECORD, or its top_level.txt)."""
    names: set[str] = set()
    for f in dist.files or ():
        top = f.parts[0]
        if top.endswith((".dist-info", ".egg-info", ".data")) or top in ("..", "__pycache__"):
            continue
        names.add(top.removesuffix(".py") if len(f.parts) == 1 else top)
    names.update((dist.read_text("top_level.txt") or "").split())
    return {n.split(".")[0] for n in names if re.fullmatch(r"[A-Za-z_][\w.]*", n)}


def runtime_modules() -> set[str]:
    """The import names of the declared runtime dependencies and everything they require."""
    todo = [Requirement(r) for r in _project()["dependencies"]]  # type: ignore[attr-defined]
    seen: set[str] = set()
    modules: set[str] = set()
    while todo:
        req = todo.pop()
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)
        modules |= _import_names(dist)
        todo += [Requirement(r) for r in dist.requires or ()]
    return modules


# Runs in `python -I`: the hook first, then the gateway in front of one simulated replica, one chat
# request over a stdlib client; then `gateway demo`, whose load client is not a runtime dependency.
CHILD = r'''
import asyncio, importlib.abc, importlib.machinery, json, os, sys, sysconfig, urllib.request

ALLOWED = set(json.loads(sys.argv[1])) | set(sys.stdlib_module_names)
STDLIB = [sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")]
STDLIB += [os.path.join(d, "lib-dynload") for d in STDLIB]
refused = set()


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ALLOWED:
            return None
        if importlib.machinery.PathFinder.find_spec(top, STDLIB) is not None:
            ALLOWED.add(top)  # the standard library's own private modules
            return None
        refused.add(top)
        raise ModuleNotFoundError(f"{top} is not a runtime dependency", name=top)


sys.meta_path.insert(0, Refuse())

import opentelemetry.exporter.otlp.proto.http.trace_exporter  # the default OTLP exporter
import uvicorn
from gateway import create_app, parse_config
from gateway.cli import main as gateway_main
from simulator.fleet import Fleet


def call(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, json.loads(res.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None


async def main():
    async with Fleet(n=1, speedup=1000.0) as fleet:
        pool = {"replicas": fleet.urls, "health": {"interval_s": 0.05}}
        app = create_app(parse_config({"pools": {"chat": pool}}))
        gw = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on",
                                           log_config=None, access_log=False, loop="none"))
        task = asyncio.create_task(gw.serve())
        while not (gw.started or task.done()):
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{gw.servers[0].sockets[0].getsockname()[1]}"
        try:
            for _ in range(200):
                if (await asyncio.to_thread(call, url + "/ready"))[0] == 200:
                    break
                await asyncio.sleep(0.05)
            body = {"model": fleet.replicas[0].model_name, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hello"}]}
            status, answer = await asyncio.to_thread(call, url + "/v1/chat/completions", body)
        finally:
            gw.should_exit = True
            await task
    print(json.dumps({"status": status, "object": (answer or {}).get("object")}))


asyncio.run(main())
print(json.dumps({"demo": gateway_main(["demo"]), "refused": sorted(refused)}))
'''


def test_gateway_serves_with_only_the_runtime_dependencies(tmp_path: Path) -> None:
    allowed = runtime_modules() | SHIPPED
    assert not allowed & {"aiohttp", "pytest", "tokenizers", "jinja2", "bench", "tests"}
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
    run = subprocess.run(
        [sys.executable, "-I", str(script), json.dumps(sorted(allowed))],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    served, demo = (json.loads(line) for line in run.stdout.splitlines()[-2:])
    assert served == {"status": 200, "object": "chat.completion"}, run.stderr[-4000:]
    # `gateway demo` without its extra: one line that says what to install, exit status 2
    assert demo["demo"] == 2
    (line,) = run.stderr.strip().splitlines()[-1:]
    assert "aiohttp" in line and "kvgateway[demo]" in line
    assert "aiohttp" in demo["refused"]
