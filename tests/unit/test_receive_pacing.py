"""INGEST_RECEIVE_WINDOW: on a trickle the pollers' receives are spaced window / pollers
apart (so one receive and one delete serve several messages); a backlog and an idle queue
are not paced. Virtual clock: the spacings asked for are recorded, nothing sleeps."""

from __future__ import annotations

import asyncio

import pytest

from service.runtime import worker as worker_module
from service.runtime.worker import ReceivePacer


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    slept: list[float] = []

    async def sleep_or_stop(seconds: float, stop: asyncio.Event) -> bool:
        slept.append(round(seconds, 6))
        now[0] += seconds
        return False

    monkeypatch.setattr(worker_module.time, "monotonic", lambda: now[0])  # type: ignore[attr-defined]
    monkeypatch.setattr(worker_module, "sleep_or_stop", sleep_or_stop)
    return slept


def poller(window: float = 1.0, pollers: int = 8, trickle: bool = True) -> ReceivePacer:
    pacer = ReceivePacer(window, pollers, asyncio.Event())
    pacer.trickle = trickle
    return pacer


async def test_a_trickle_spaces_receives_window_over_pollers_apart(clock: list[float]) -> None:
    w = poller()
    for _ in range(4):  # four pollers asking at the same instant
        await w.pace()
    # The first goes at once; each next one 1/8 s after the one before (the clock moved
    # on by the sleeps recorded, as the pollers' own sleeps would).
    assert clock == [0.125, 0.125, 0.125]


@pytest.mark.parametrize(("trickle", "window"), [(False, 1.0), (True, 0.0)])
async def test_no_pacing_for_a_backlog_an_idle_queue_or_a_window_of_0(
        clock: list[float], trickle: bool, window: float) -> None:
    w = poller(window=window, trickle=trickle)
    for _ in range(4):
        await w.pace()
    assert clock == []
