"""The retry policy alone: every delay the daemon decides, with literal expectations."""

from __future__ import annotations

import asyncio

from service.retry import Backoff, RetryPolicy


def test_backoff_doubles_per_receive_with_equal_jitter_and_a_cap() -> None:
    low = RetryPolicy(base_seconds=2, max_seconds=900, rng=lambda: 0.0)
    high = RetryPolicy(base_seconds=2, max_seconds=900, rng=lambda: 0.999999)
    assert [low.backoff(n) for n in (1, 2, 3, 4, 9, 10, 40)] == [1, 2, 4, 8, 256, 450, 450]
    assert [high.backoff(n) for n in (1, 2, 3, 4, 9, 10)] == [2, 4, 8, 16, 512, 900]
    assert low.backoff(0) == 1  # a missing receive count is the first receive


def test_jitter_never_exceeds_the_sqs_visibility_limit() -> None:
    p = RetryPolicy(base_seconds=43_200, max_seconds=43_200, rng=lambda: 0.999999)
    assert p.backoff(30) == 43_200


def test_contention_and_hand_back_delays() -> None:
    p = RetryPolicy(base_seconds=2, contention_seconds=5, rng=lambda: 0.0)
    assert p.contention() == 3 and p.hand_back() == 1
    assert RetryPolicy(contention_seconds=0, rng=lambda: 0.0).contention() == 1  # never 0


def test_limits() -> None:
    p = RetryPolicy(max_failures=3)
    assert [p.exhausted(n) for n in (2, 3, 4)] == [False, True, True]
    assert [p.repeat_offender(n) for n in (9, 10)] == [False, True]


async def test_reconnect_backoff_doubles_to_its_cap_and_stops_on_the_event() -> None:
    b = Backoff(first=0.01, cap=0.03)
    stop = asyncio.Event()
    seen = []
    for _ in range(4):
        seen.append(b.delay)
        assert await b.wait(stop) is False
    assert seen == [0.01, 0.02, 0.03, 0.03]
    b.reset()
    assert b.delay == 0.01
    stop.set()
    assert await Backoff(first=3600).wait(stop) is True  # returns at once when stopping
