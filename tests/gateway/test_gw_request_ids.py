"""New request ids (gateway/pipeline/steps.py `request_id`): 32 hex digits, never repeated within a
process, and a forked child (a worker) draws a prefix of its own; a client's id is kept."""

from __future__ import annotations

import subprocess
import sys

from gateway.pipeline.record import request_id


def test_new_ids_are_unique_hex_and_a_clients_id_is_kept() -> None:
    ids = [request_id({}) for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert request_id({b"x-request-id": b"abc"}) == "abc"
    assert request_id({b"x-request-id": b"x" * 500}) == "x" * 128


# In a process of its own: this one has threads, and forking one that has is deprecated.
_FORK = """
import os
from gateway.pipeline.record import request_id
parent = request_id({})
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, request_id({}).encode())
    os._exit(0)
os.close(write)
child = os.read(read, 64).decode()
os.waitpid(pid, 0)
print(parent, child)
"""


def test_a_forked_child_draws_its_own_prefix() -> None:
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True, check=True)
    parent, child = out.stdout.split()
    assert len(child) == 32 and child[:16] != parent[:16]
