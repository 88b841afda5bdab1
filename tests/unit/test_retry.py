"""The retry policy alone: every delay the daemon decides, with literal expectations."""

from __future__ import annotations

import asyncio

from service.core.retry import Backoff, ReceiveLimit, RedrivePolicy, RetryPolicy


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


def test_the_policy_is_read_from_the_settings() -> None:
    from service.settings import Settings

    s = Settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://u@h/d",
                 retry_base_seconds=3, retry_max_seconds=70, contention_delay=11,
                 max_receive_count=4)

    def rng() -> float:
        return 0.5

    p = RetryPolicy.from_settings(s, rng)
    assert (p.base_seconds, p.max_seconds, p.contention_seconds, p.max_failures, p.rng) == (
        3, 70, 11, 4, rng)


def redrive(value: str) -> dict[str, str]:
    return {"RedrivePolicy": value}


def test_the_queue_s_redrive_policy_is_read_or_none() -> None:
    arn = "arn:aws:sqs:us-east-1:000000000000:dlq"
    assert RedrivePolicy.from_attributes(redrive(
        f'{{"deadLetterTargetArn":"{arn}","maxReceiveCount":7}}')) == RedrivePolicy(arn, 7)
    # Some tools store the count as a string.
    assert RedrivePolicy.from_attributes(redrive(
        f'{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"3"}}')) == RedrivePolicy(arn, 3)
    assert RedrivePolicy.from_attributes({}) is None
    assert RedrivePolicy.from_attributes(redrive("")) is None
    for unreadable in ("{not json", '{"maxReceiveCount":3}', f'{{"deadLetterTargetArn":"{arn}"}}',
                       f'{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"x"}}', "[1]"):
        assert RedrivePolicy.from_attributes(redrive(unreadable)) is None, unreadable


def with_policy(configured: int, max_receive_count: int, fifo: bool = False) -> ReceiveLimit:
    limit = ReceiveLimit(configured, fifo) if fifo else ReceiveLimit(configured)
    limit.policy = RedrivePolicy("arn:aws:sqs:us-east-1:000000000000:dlq", max_receive_count)
    return limit


def test_the_receive_limit_under_a_redrive_policy() -> None:
    assert ReceiveLimit(5).max_failures == 5 and not ReceiveLimit(5).last_receive(99)
    limit = with_policy(5, 3)
    assert limit.max_failures == 3  # lowered by the policy
    assert [limit.last_receive(n) for n in (2, 3, 4)] == [False, True, True]
    # On SQS's last receive a first failure is already final.
    assert limit.exhausted(1, 3) and not limit.exhausted(1, 2) and limit.exhausted(3, 1)
    assert with_policy(2, 9).max_failures == 2


def test_a_fresh_copy_only_when_a_hand_back_would_leave_too_few_receives() -> None:
    """Standard queue: when fewer receives are left than the daemon's tries. FIFO: only when
    the next receive would move it (a copy goes behind its group's later messages)."""
    assert not ReceiveLimit(2).must_requeue(99)  # no policy: SQS never moves it
    standard = with_policy(2, 5)
    assert [standard.must_requeue(n) for n in (1, 2, 3, 4, 5)] == [False] * 3 + [True] * 2
    fifo = with_policy(2, 5, fifo=True)
    assert fifo.fifo is True and ReceiveLimit(2).fifo is False
    assert [fifo.must_requeue(n) for n in (3, 4, 5, 6)] == [False, False, True, True]


def test_update_takes_the_policy_and_says_whether_it_changed() -> None:
    arn = "arn:aws:sqs:us-east-1:000000000000:dlq"
    limit = ReceiveLimit(5)
    seven = redrive(f'{{"deadLetterTargetArn":"{arn}","maxReceiveCount":7}}')
    assert limit.update(seven) is True and limit.policy == RedrivePolicy(arn, 7)
    assert limit.update(seven) is False and limit.policy == RedrivePolicy(arn, 7)
    assert limit.update(redrive(seven["RedrivePolicy"].replace("7", "3"))) is True
    assert limit.max_failures == 3
    assert limit.update({}) is True and limit.policy is None and limit.max_failures == 5
    assert limit.update({}) is False


async def test_wait_any_returns_when_one_event_is_set() -> None:
    from service.core.retry import wait_any

    a, b = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().call_soon(b.set)
    await asyncio.wait_for(wait_any(a, b), 10)
    assert b.is_set() and not a.is_set()
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    await asyncio.sleep(0)
    assert all(t.done() for t in pending)  # the other waiter is cancelled, not leaked


def test_the_lowered_limit_warning_is_only_for_a_policy_below_the_configured_count() -> None:
    """What the operator reads when the queue's RedrivePolicy is read: a warning only when
    its maxReceiveCount is below INGEST_MAX_RECEIVE_COUNT (the daemon's limit is lowered);
    equal or above is the plain info line — the limit stays as configured."""
    from structlog.testing import capture_logs

    arn = "arn:aws:sqs:us-east-1:000000000000:dlq"
    events = []
    for count in (4, 5, 6):
        with capture_logs() as logs:
            assert ReceiveLimit(5).update(
                redrive(f'{{"deadLetterTargetArn":"{arn}","maxReceiveCount":{count}}}'))
        events += [(count, e["event"], e["log_level"]) for e in logs]
    assert events == [(4, "receive_limit_lowered_by_redrive_policy", "warning"),
                      (5, "redrive_policy", "info"), (6, "redrive_policy", "info")]
