"""Generated request ids are unique within a process and across forked workers."""

from __future__ import annotations

import os

from tokenpipe import request_ids


def test_ids_are_unique_and_look_like_uuid4_hex() -> None:
    ids = [request_ids.new() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_a_forked_worker_draws_its_own_prefix() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its first id and leave without running any cleanup
        os.write(write, request_ids.new().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32
    assert child[:16] != request_ids.new()[:16]
