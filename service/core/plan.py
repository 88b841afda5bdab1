"""A batch as a value: pure functions that turn parse, claim and apply results into a
``Plan`` — what to dead-letter, ack, hand back and count — without any I/O.

``service.runtime.executor`` carries a plan out in the one safe order: dead letters committed →
deletes → visibility changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

import structlog

from service.core.labels import INVALID_TYPE_LABEL
from service.core.limits import storable
from service.core.messages import Message, Poison, Received, parse
from service.core.pointers import Fetched, Pointer, Refused, Unreachable
from service.core.registry import Registry
from service.core.retry import ReceiveLimit, RetryPolicy
from service.core.seams import ApplyResult, ClaimResult, DeadLetter, KnownPointer
from service.errors import driver_error

log = structlog.get_logger("sqs_ingest.worker")
_s3_log = structlog.get_logger("sqs_ingest.payloads")

__all__ = [
    "INVALID_TYPE_LABEL", "ClaimPlan", "Plan", "Triage", "classify", "describe",
    "letters_ahead", "plan_unresolved", "settle", "settle_failures", "triage",
    "wait_behind_letters",
]


@dataclass(slots=True)
class Plan:
    """What to do with the messages of a batch whose fate is decided."""

    letters: list[DeadLetter] = field(default_factory=list)  # commit before any ack
    acks: list[Received] = field(default_factory=list)  # delete once the letters are committed
    releases: list[tuple[Received, int]] = field(default_factory=list)  # visibility, last
    # Handed back through no fault of their own (contention, FIFO group blocked): near the
    # queue's maxReceiveCount these are sent again as fresh copies (service.ops.redrive).
    deferrals: list[tuple[Received, int]] = field(default_factory=list)
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (type label, outcome)
    # S3 objects of completed requests: deleted after the ack (INGEST_S3_DELETE_AFTER_ACK).
    offloaded: list[Pointer] = field(default_factory=list)
    dead_letter_reasons: list[str] = field(default_factory=list)  # dead_letters_total
    lags: list[float] = field(default_factory=list)  # commit time - SentTimestamp
    contention: int = 0  # deferrals because another owner held the claim
    labels: dict[str, str] = field(default_factory=dict)  # a letter's message id → type label

    def letter(self, received: Received, d: DeadLetter, label: str) -> None:
        self.letters.append(d)
        self.labels[received.message_id] = label
        self.ack(received, label, "dead_lettered")
        self.dead_letter_reasons.append(d.reason)

    def ack(self, received: Received, label: str, outcome: str) -> None:
        self.acks.append(received)
        self.outcomes.append((label, outcome))

    def release(self, received: Received, delay: int) -> None:
        self.releases.append((received, delay))

    def defer(self, received: Received, delay: int) -> None:
        self.deferrals.append((received, delay))

    def hold_followers(self, position: Mapping[str, int] | None = None) -> None:
        """FIFO: no message handed back becomes visible before an earlier one of its group
        handed back with it (``hold_behind``)."""
        back = hold_behind([*self.releases, *self.deferrals], position)
        n = len(self.releases)
        self.releases, self.deferrals = back[:n], back[n:]

    def hold_letters(self, position: Mapping[str, int],
                     written: AbstractSet[str] = frozenset()) -> None:
        """FIFO: a dead letter behind a message of its group that is handed back is not
        written now but handed back too (``hold_followers`` makes it wait as long), so that
        its result never leaves before that message's (``position``: message id → place in
        the batch; ``written``: the letters committed already, kept)."""
        if not self.letters:
            return
        first = _first_in_group(((r.group_id, r.message_id)
                                 for r, _ in (*self.releases, *self.deferrals)), position)
        held = {d.sqs_message_id for d in self.letters if d.sqs_message_id not in written
                and _behind(d.group_id, d.sqs_message_id, first, position)}
        if not held:
            return
        for d in [d for d in self.letters if d.sqs_message_id in held]:
            self.letters.remove(d)
            self.dead_letter_reasons.remove(d.reason)
            self.outcomes.remove((self.labels.pop(d.sqs_message_id), "dead_lettered"))
        for r in [r for r in self.acks if r.message_id in held]:
            self.acks.remove(r)
            self.defer(r, 0)

    def merge(self, other: Plan) -> Plan:
        self.letters += other.letters
        self.labels.update(other.labels)
        self.acks += other.acks
        self.releases += other.releases
        self.deferrals += other.deferrals
        self.outcomes += other.outcomes
        self.offloaded += other.offloaded
        self.dead_letter_reasons += other.dead_letter_reasons
        self.lags += other.lags
        self.contention += other.contention
        return self


@dataclass(slots=True)
class Triage:
    """A parsed batch: one message per request_id to claim, the rest decided already."""

    primaries: list[Message]
    plan: Plan  # poison dead-lettered; twins handed back


def triage(
    batch: Sequence[Received], registry: Registry, policy: RetryPolicy,
    fetched: Mapping[str, Fetched] | None = None,
) -> Triage:
    """Parse every body (``fetched``: the S3 payloads of pointer bodies, by message id).
    Poison is dead-lettered; the same request_id twice in one batch is decided on the
    second copy's next delivery, after the first one's outcome."""
    plan = Plan()
    primaries: dict[str, Message] = {}
    for raw in batch:
        item = parse(raw, registry, fetched.get(raw.message_id) if fetched else None)
        if isinstance(item, Poison):
            log.warning("poison_message", message_id=raw.message_id,
                        request_id=item.request_id, reason=item.reason, error=item.error)
            label = item.type if item.type is not None and item.type in registry \
                else INVALID_TYPE_LABEL
            plan.letter(raw, DeadLetter.of_poison(item), label)
        elif item.request_id in primaries:
            plan.defer(raw, policy.contention())
        else:
            primaries[item.request_id] = item
    return Triage(list(primaries.values()), plan)


@dataclass(slots=True)
class ClaimPlan:
    to_apply: list[Message]  # claimed by us: run the handlers
    unclaim: list[Message]  # claimed, but must wait (FIFO, behind its group): give back now
    plan: Plan


def classify(
    primaries: Sequence[Message],
    claims: Mapping[str, ClaimResult],
    policy: RetryPolicy,
    fifo: bool,
) -> ClaimPlan:
    """Sort claim results into apply / duplicate / conflict / defer (batch order: FIFO order
    within a group; a message that has to wait holds back the rest of its group, for at
    least as long as it waits itself — never visible before it)."""
    out = ClaimPlan([], [], Plan())
    blocked_groups: dict[str, int] = {}  # group → how long its head waits
    for m in primaries:
        c = claims[m.request_id]
        group = m.raw.group_id if fifo else None
        if group is not None and group in blocked_groups:
            out.plan.defer(m.raw, blocked_groups[group])
            if c.claimed:
                out.unclaim.append(m)
        elif c.dead_lettered:
            # Dead-lettered on an earlier delivery whose ack never happened.
            out.plan.ack(m.raw, m.type, "dead_lettered")
        elif c.held:
            # FIFO: an earlier message of its group is claimed (IN_PROGRESS) by some owner,
            # dead or alive — wait for it as for a contended claim; the broker's group lock
            # is not relied on (SPEC §6 "FIFO order").
            delay = _contend(out.plan, m, policy, group, blocked_groups)
            log.info("fifo_group_held", message_id=m.raw.message_id, request_id=m.request_id,
                     group=m.raw.group_id, retry_in=delay)
        elif c.claimed:
            # A new value with the claim's failure count: the parsed message stays as parsed.
            out.to_apply.append(m if m.failures == c.failures else replace(m, failures=c.failures))
        elif c.status is not None and (
            c.payload_sha256 != m.payload_sha256 or c.request_type != m.type
        ):
            _key_reused(out.plan, m, c)
        elif c.status == "COMPLETED":
            out.plan.ack(m.raw, m.type, "duplicate")
        else:
            # IN_PROGRESS under another owner (or committed after our snapshot): come back
            # after it finished. Not a failure: does not count towards the limit.
            _contend(out.plan, m, policy, group, blocked_groups)
    return out


def _contend(plan: Plan, m: Message, policy: RetryPolicy, group: str | None,
             blocked_groups: dict[str, int]) -> int:
    """Hand a contended message back for the contention delay (no failure counted); on a
    FIFO queue its group waits as long behind it. Returns the delay."""
    delay = policy.contention()
    plan.defer(m.raw, delay)
    plan.contention += 1
    if group is not None:
        blocked_groups[group] = delay
    return delay


def _key_reused(plan: Plan, m: Message, c: ClaimResult) -> None:
    log.warning("idempotency_key_reused", message_id=m.raw.message_id,
                request_id=m.request_id)
    plan.letter(m.raw, DeadLetter.of_message(
        m, "idempotency_key_reused",
        f"request_id already used with payload_sha256={c.payload_sha256} "
        f"type={c.request_type}",
    ), m.type)


def hold_behind(
    back: Sequence[tuple[Received, int]], position: Mapping[str, int] | None = None
) -> list[tuple[Received, int]]:
    """FIFO: every message handed back waits at least as long as any earlier message of its
    group handed back with it (by SequenceNumber, else by ``position``: message id → place
    in the batch as received) — a follower made visible before its head could be received
    and applied first on a broker that does not keep the group locked (SPEC §6)."""
    pos = position or {}

    def key(i: int) -> tuple[str, int, int]:
        r = back[i][0]
        return (r.group_id or "", r.sequence_number or 0, pos.get(r.message_id, i))

    order = sorted(range(len(back)), key=key)
    out = list(back)
    floor: dict[str, int] = {}
    for i in order:
        r, delay = back[i]
        if r.group_id is None:
            continue
        delay = max(delay, floor.get(r.group_id, 0))
        floor[r.group_id] = delay
        out[i] = (r, delay)
    return out


def letters_ahead(
    letters: Sequence[DeadLetter], to_apply: Sequence[Message], position: Mapping[str, int]
) -> list[DeadLetter]:
    """FIFO: the dead letters no message to apply precedes in its group (by ``position``:
    message id → place in the batch as received). Only those are written before the
    handlers' commit; the others after it (``PlanExecutor.carry_out``), so that their
    results follow the results of the messages ahead of them."""
    first = _first_in_group(((m.raw.group_id, m.raw.message_id) for m in to_apply), position)
    return [d for d in letters if not _behind(d.group_id, d.sqs_message_id, first, position)]


def wait_behind_letters(c: ClaimPlan, letters: Sequence[DeadLetter],
                        position: Mapping[str, int]) -> None:
    """FIFO: a message to apply behind a dead letter that is written after the commit
    (``letters_ahead``) waits for the next receive (given back, handed back at once): it
    would commit, and its result leave, before that letter's."""
    ahead = {d.sqs_message_id for d in letters_ahead(letters, c.to_apply, position)}
    first = _first_in_group(((d.group_id, d.sqs_message_id) for d in letters
                             if d.sqs_message_id not in ahead), position)
    if not first:
        return
    to_apply = []
    for m in c.to_apply:
        if _behind(m.raw.group_id, m.raw.message_id, first, position):
            c.unclaim.append(m)
            c.plan.defer(m.raw, 0)
        else:
            to_apply.append(m)
    c.to_apply = to_apply


def _first_in_group(messages: Iterable[tuple[str | None, str]], position: Mapping[str, int]
                    ) -> dict[str, int]:
    """Group → the place in the batch of its first message among ``messages`` (group,
    message id)."""
    first: dict[str, int] = {}
    for group, message_id in messages:
        if group is not None:
            at = position.get(message_id, 0)
            first[group] = min(at, first.get(group, at))
    return first


def _behind(group: str | None, message_id: str, first: Mapping[str, int],
            position: Mapping[str, int]) -> bool:
    return group is not None and group in first and position.get(message_id, 0) > first[group]


def settle(res: ApplyResult, policy: RetryPolicy) -> Plan:
    """Completed → ack; claim lost to GC → come back later; FIFO-blocked → as long as what
    blocks it (raised to that by ``Plan.hold_followers``).
    Handler failures are settled by ``settle_failures`` once they are counted."""
    plan = Plan()
    for m, _ in res.completed:
        plan.ack(m.raw, m.type, "completed")
        if m.pointer is not None:
            plan.offloaded.append(m.pointer)
        if m.raw.sent_timestamp:
            plan.lags.append(max(0.0, res.committed_at - m.raw.sent_timestamp))
    for m in res.lost:
        log.warning("claim_lost", message_id=m.raw.message_id, request_id=m.request_id)
        plan.defer(m.raw, policy.contention())
    for m in res.blocked:
        plan.defer(m.raw, 0)
    return plan


def describe(exc: BaseException) -> str:
    """A storable one-line error (recorded in retry_attempts and dead_letters): of an error
    the store translated, the database's own (``errors.driver_error``)."""
    exc = driver_error(exc)
    try:
        text = str(exc)
    except Exception as err:  # a handler's exception that cannot print itself still failed
        text = f"<its str() raised {type(err).__name__}>"
    return storable(f"{type(exc).__name__}: {text}")[:2000]


def settle_failures(
    failures: Sequence[tuple[Message, str]], counts: Mapping[str, int], policy: RetryPolicy,
    limit: ReceiveLimit,
) -> Plan:
    """A handler failure is retried after a backoff; at the limit — the live one, lowered by
    the queue's RedrivePolicy, or SQS's last receive — it is dead-lettered (already
    committed by ``record_failures``) and acked."""
    plan = Plan()
    for m, err in failures:
        n = counts.get(m.request_id)
        if n is None:  # its claim was gone when it was recorded: not this batch's to count
            log.warning("claim_lost", message_id=m.raw.message_id, request_id=m.request_id)
            plan.defer(m.raw, policy.contention())
        elif limit.exhausted(n, m.raw.receive_count):
            plan.ack(m.raw, m.type, "dead_lettered")
            plan.dead_letter_reasons.append("max_receives_exceeded")
            log.error("dead_lettered_after_retries", message_id=m.raw.message_id,
                      request_id=m.request_id, failures=n, error=err)
        else:
            delay = policy.backoff(m.raw.receive_count)
            plan.release(m.raw, delay)
            plan.outcomes.append((m.type, "retried"))
            log.warning("handler_failed", message_id=m.raw.message_id,
                        request_id=m.request_id, failures=n, retry_in=delay, error=err)
    return plan


def plan_unresolved(
    unresolved: Sequence[tuple[Received, Refused | Unreachable]],
    known: Mapping[str, KnownPointer],
    policy: RetryPolicy,
    refused_for: Mapping[str, float] | None = None,
    unreadable_after: float = float("inf"),
) -> Plan:
    """Decide messages whose payload could not be read. A missing object whose pointer was
    claimed by a COMPLETED request is a duplicate (the object was deleted after that
    request's ack, opt-in); one still IN_PROGRESS waits like any contention; otherwise
    the message is a dead letter that keeps its pointer body. S3 failures are deferred
    with backoff (not the message's fault) — unless the pointer's request is COMPLETED:
    then, as for a missing object, the message is its duplicate; or unless S3 has refused
    the pointer for ``unreadable_after`` seconds or more (``refused_for``, from its first
    refusal): then it is a dead letter, ``payload_unreadable``, that keeps its pointer body
    (``dlq replay`` once access is fixed)."""
    plan = Plan()
    for raw, r in unresolved:
        if isinstance(r, Unreachable):
            done = known.get(r.pointer.uri)
            if done is not None and done.status == "COMPLETED":
                # Its request needs no payload: deferred, it would cycle as long as S3
                # refuses, outliving the request's row (retention) and then applied again.
                plan.ack(raw, done.request_type, "duplicate")
                continue
            age = (refused_for or {}).get(r.pointer.uri) if r.refused else None
            if age is not None and age >= unreadable_after:
                error = (f"{r.error} (refused for {age:.0f} s since the first refusal, "
                         f"INGEST_S3_UNREADABLE_AFTER={unreadable_after:g})")
                _s3_log.warning("poison_message", message_id=raw.message_id,
                                reason="payload_unreadable", error=error)
                plan.letter(raw, DeadLetter.of_received(raw, "payload_unreadable", error),
                            INVALID_TYPE_LABEL)
                continue
            # Not the message's fault: a deferral (an S3 outage never pushes it to the
            # queue's own DLQ; service.ops.redrive), after the usual backoff.
            plan.defer(raw, policy.backoff(raw.receive_count))
            continue
        owner = known.get(r.pointer.uri) if r.pointer is not None \
            and r.reason == "payload_object_missing" else None
        if owner is not None and owner.status == "COMPLETED":
            plan.ack(raw, owner.request_type, "duplicate")
        elif owner is not None:
            plan.defer(raw, policy.contention())
            plan.contention += 1
        else:
            _s3_log.warning("poison_message", message_id=raw.message_id, reason=r.reason,
                        error=r.error)
            plan.letter(raw, DeadLetter.of_received(raw, r.reason, r.error), INVALID_TYPE_LABEL)
    return plan
