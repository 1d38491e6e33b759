"""`gateway demo` runs end to end on the ports it is given (a short run: a few requests)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import free_port


def test_the_demo_runs_on_the_ports_it_is_given() -> None:
    port, replica_port = free_port(), free_port()
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--requests", "8", "--replicas", "1",
         "--speedup", "50", "--port", str(port), "--replica-port", str(replica_port)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"gateway http://127.0.0.1:{port}" in out.stdout
    assert f"replicas http://127.0.0.1:{replica_port}" in out.stdout
    assert "ttft vs round_robin: hit ratio" in out.stdout
