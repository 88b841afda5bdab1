"""tests/servers.py's free_port: the port a test reserves for a server it starts next is
nobody else's pick while that server starts — neither this process's next reservation nor
the other xdist worker's, nor the kernel's for anyone's ``bind`` to port 0."""

from __future__ import annotations

import pytest

from tests import servers


def test_a_port_is_never_handed_out_twice_in_a_process() -> None:
    # The kernel's pick repeats a reserved, not yet bound port about once in 14,000 calls
    # (the odd ports of 32768-60999): 3,000 picks all but surely hold a repeat.
    ports = [servers.free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_ports_are_outside_the_ephemeral_range() -> None:
    lo, hi = servers._ephemeral_range()
    assert not any(lo <= servers.free_port() <= hi for _ in range(200))


def test_xdist_workers_pick_from_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    picked = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        picked[worker] = {servers.free_port() for _ in range(300)}
    assert max(picked["gw0"]) < min(picked["gw1"])
