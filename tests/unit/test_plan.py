"""The batch plan, without I/O: literal batches in, literal plans out."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from service.core.messages import Message, Received
from service.core.plan import (
    INVALID_TYPE_LABEL,
    ClaimPlan,
    Plan,
    classify,
    hold_behind,
    letters_ahead,
    settle,
    settle_failures,
    triage,
    wait_behind_letters,
)
from service.core.retry import ReceiveLimit, RetryPolicy
from service.core.seams import ApplyResult, ClaimResult, DeadLetter
from service.handlers import Registry

POLICY = RetryPolicy(base_seconds=2, max_seconds=900, contention_seconds=4, max_failures=3,
                     rng=lambda: 0.0)


class Note(BaseModel):
    n: int


async def _note(p: Note, conn: Any) -> None:
    return None


def registry() -> Registry:
    r = Registry()
    r.register("note", Note, _note)
    return r


def raw(mid: str, body: str, receives: int = 1, group: str | None = None,
        sent: float | None = None, seq: int | None = None) -> Received:
    return Received(mid, "rh-" + mid, body, receives, sent, group, sequence_number=seq)


def note(rid: str, n: int = 1) -> str:
    return json.dumps({"request_id": rid, "type": "note", "payload": {"n": n}})


def parsed(mid: str, rid: str, group: str | None = None, receives: int = 1,
           sent: float | None = None, seq: int | None = None) -> Message:
    t = triage([raw(mid, note(rid), receives, group, sent, seq)], registry(), POLICY)
    [m] = t.primaries
    return m


def claim(rid: str, claimed: bool = False, status: str | None = None,
          sha: str | None = None, owner: str | None = None, dead: bool = False,
          type_: str = "note", held: bool = False) -> ClaimResult:
    return ClaimResult(rid, claimed, status, type_ if status else None, sha, owner, 0, dead,
                       held)


def test_triage_letters_poison_and_holds_back_a_twin() -> None:
    batch = [raw("m1", note("r1")), raw("m2", "{nope"), raw("m3", note("r1")),
             raw("m4", json.dumps({"request_id": "r4", "type": "other", "payload": {}}))]
    t = triage(batch, registry(), POLICY)
    assert [m.request_id for m in t.primaries] == ["r1"]
    assert [(d.sqs_message_id, d.reason, d.body) for d in t.plan.letters] == [
        ("m2", "invalid_json", "{nope"), ("m4", "unknown_type", batch[3].body)]
    assert [a.message_id for a in t.plan.acks] == ["m2", "m4"]
    assert t.plan.outcomes == [(INVALID_TYPE_LABEL, "dead_lettered"),
                               (INVALID_TYPE_LABEL, "dead_lettered")]
    assert t.plan.dead_letter_reasons == ["invalid_json", "unknown_type"]
    assert [(r.message_id, d) for r, d in t.plan.deferrals] == [("m3", 2)]  # contention delay


def test_classify_each_claim_outcome() -> None:
    ms = [parsed("m1", "new"), parsed("m2", "done"), parsed("m3", "reused"),
          parsed("m4", "busy"), parsed("m5", "lettered")]
    sha = ms[1].payload_sha256
    claims = {
        "new": claim("new", claimed=True),
        "done": claim("done", status="COMPLETED", sha=sha),
        "reused": claim("reused", status="COMPLETED", sha="0" * 64),
        "busy": claim("busy", status="IN_PROGRESS", sha=sha, owner="other"),
        "lettered": claim("lettered", dead=True),
    }
    c = classify(ms, claims, POLICY, fifo=False)
    assert [m.request_id for m in c.to_apply] == ["new"] and c.unclaim == []
    assert [(a.message_id, o) for a, o in zip(c.plan.acks, c.plan.outcomes, strict=True)] == [
        ("m2", ("note", "duplicate")), ("m3", ("note", "dead_lettered")),
        ("m5", ("note", "dead_lettered"))]
    assert [(d.sqs_message_id, d.reason) for d in c.plan.letters] == [
        ("m3", "idempotency_key_reused")]
    assert c.plan.dead_letter_reasons == ["idempotency_key_reused"]
    assert [(r.message_id, d) for r, d in c.plan.deferrals] == [("m4", 2)]
    assert c.plan.contention == 1


def test_classify_same_hash_other_type_is_a_conflict() -> None:
    m = parsed("m1", "r1")
    c = classify([m], {"r1": claim("r1", status="COMPLETED", sha=m.payload_sha256,
                                   type_="invoice")}, POLICY, fifo=False)
    assert [d.reason for d in c.plan.letters] == ["idempotency_key_reused"]


def test_fifo_wait_holds_back_the_rest_of_the_group_and_gives_claims_back() -> None:
    ms = [parsed("m1", "a1", "A"), parsed("m2", "a2", "A"), parsed("m3", "b1", "B"),
          parsed("m4", "a3", "A")]
    claims = {"a1": claim("a1", status="IN_PROGRESS", sha=ms[0].payload_sha256, owner="other"),
              "a2": claim("a2", claimed=True), "b1": claim("b1", claimed=True),
              "a3": claim("a3", status="COMPLETED", sha=ms[3].payload_sha256)}
    c = classify(ms, claims, POLICY, fifo=True)
    assert [m.request_id for m in c.to_apply] == ["b1"]
    assert [m.request_id for m in c.unclaim] == ["a2"]
    # The followers wait as long as their head (never visible before it: issue 25).
    assert [(r.message_id, d) for r, d in c.plan.deferrals] == [("m1", 2), ("m2", 2), ("m4", 2)]
    assert c.plan.acks == []  # a3's duplicate waits behind a1 too
    # The same batch on a standard queue: no group holds anything back.
    s = classify(ms, claims, POLICY, fifo=False)
    assert [m.request_id for m in s.to_apply] == ["a2", "b1"]
    assert [a.message_id for a in s.plan.acks] == ["m4"]


def test_fifo_claim_held_behind_an_unfinished_earlier_message_holds_its_group() -> None:
    """A message the claim held (an earlier one of its group is IN_PROGRESS under some
    owner, dead or alive) is deferred like contention, and its group's later messages in the
    batch wait at least as long, their claims given back; other groups go on."""
    ms = [parsed("m1", "a2", "A"), parsed("m2", "b1", "B"), parsed("m3", "a3", "A")]
    claims = {"a2": claim("a2", held=True), "b1": claim("b1", claimed=True),
              "a3": claim("a3", claimed=True)}
    c = classify(ms, claims, POLICY, fifo=True)
    assert [m.request_id for m in c.to_apply] == ["b1"]
    assert [m.request_id for m in c.unclaim] == ["a3"]
    assert [(r.message_id, d) for r, d in c.plan.deferrals] == [("m1", 2), ("m3", 2)]
    assert c.plan.contention == 1
    assert c.plan.acks == []


def test_hold_behind_followers_never_visible_before_what_blocks_them() -> None:
    """A failed head released after a backoff (8 s) and its group's later messages handed
    back as blocked (0): they wait 8 s too; order by SequenceNumber, whatever the list order;
    another group and an earlier message keep their own delays."""
    head = raw("m1", note("a1"), group="A", seq=100)
    follower = raw("m2", note("a2"), group="A", seq=200)
    earlier = raw("m0", note("a0"), group="A", seq=50)
    other = raw("m3", note("b1"), group="B", seq=150)
    plan = Plan()
    plan.release(head, 8)
    plan.defer(follower, 0)
    plan.defer(other, 0)
    plan.defer(earlier, 1)
    plan.hold_followers()
    assert [(r.message_id, d) for r, d in plan.releases] == [("m1", 8)]
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("m2", 8), ("m3", 0), ("m0", 1)]
    # Without sequence numbers: the batch order the caller passes.
    a, b = raw("x1", note("x1"), group="X"), raw("x2", note("x2"), group="X")
    assert hold_behind([(b, 0), (a, 6)], {"x1": 0, "x2": 1}) == [(b, 6), (a, 6)]
    assert hold_behind([(b, 0), (a, 6)], {"x1": 1, "x2": 0}) == [(b, 0), (a, 6)]
    # Standard queue messages (no group) are never touched.
    c = raw("s1", note("s1"))
    assert hold_behind([(c, 0), (raw("s0", note("s0")), 9)]) == [(c, 0), (raw("s0", note("s0")), 9)]


def test_settle_acks_completed_and_hands_back_lost_and_blocked() -> None:
    done, lost, blocked = (parsed("m1", "r1", sent=100.0), parsed("m2", "r2"),
                           parsed("m3", "r3"))
    res = ApplyResult(completed=[(done, {"ok": True})], lost=[lost], blocked=[blocked],
                      committed_at=102.5)
    plan = settle(res, POLICY)
    assert [a.message_id for a in plan.acks] == ["m1"]
    assert plan.outcomes == [("note", "completed")]
    assert plan.lags == [2.5]
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("m2", 2), ("m3", 0)]


def test_settle_failures_backs_off_then_acks_the_exhausted() -> None:
    early, late = parsed("m1", "r1", receives=3), parsed("m2", "r2", receives=5)
    plan = settle_failures([(early, "boom"), (late, "boom")], {"r1": 2, "r2": 3}, POLICY,
                           ReceiveLimit(POLICY.max_failures))
    assert [(r.message_id, d) for r, d in plan.releases] == [("m1", 4)]  # 2 * 2^2 / 2
    assert [a.message_id for a in plan.acks] == ["m2"]
    assert plan.outcomes == [("note", "retried"), ("note", "dead_lettered")]
    assert plan.dead_letter_reasons == ["max_receives_exceeded"]
    assert plan.letters == []  # committed by record_failures already


def test_a_failure_record_failures_did_not_count_is_a_lost_claim() -> None:
    """Its claim was gone when the failure was recorded (GC took it): not counted, so
    neither retried nor dead-lettered here; it comes back like any lost claim."""
    lost = parsed("m1", "r1", receives=5)
    plan = settle_failures([(lost, "boom")], {}, POLICY, ReceiveLimit(POLICY.max_failures))
    assert (plan.acks, plan.releases, plan.dead_letter_reasons) == ([], [], [])
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("m1", POLICY.contention())]


def test_describe_is_the_exception_type_and_text_capped_at_2000() -> None:
    from service.core.plan import describe

    assert describe(RuntimeError("boom")) == "RuntimeError: boom"
    long = describe(ValueError("x" * 5000))
    assert len(long) == 2000 and long.startswith("ValueError: xxx")


def test_classify_returns_new_values_and_leaves_its_input_as_parsed() -> None:
    """The failure count the claim found goes into the message to apply, a new value: the
    parsed message (held by the batch's claims list) is not changed."""
    m = parsed("m1", "r1")
    found = ClaimResult("r1", True, None, None, None, None, 2)
    c = classify([m], {"r1": found}, POLICY, fifo=False)
    [to_apply] = c.to_apply
    assert (to_apply.request_id, to_apply.failures) == ("r1", 2)
    assert m.failures == 0 and to_apply is not m


def test_merge_concatenates_every_list_and_adds_the_contention() -> None:
    from service.core.pointers import Pointer
    from service.core.seams import DeadLetter

    def one(mid: str, contention: int) -> Plan:
        r = raw(mid, note(mid))
        p = Plan()
        p.letter(r, DeadLetter.of_received(r, "invalid_json", mid), INVALID_TYPE_LABEL)
        p.release(r, 1)
        p.defer(r, 2)
        p.offloaded.append(Pointer("b", mid))
        p.lags.append(float(len(mid)))
        p.contention = contention
        return p

    a, b = one("a", 2), one("bb", 3)
    merged = a.merge(b)
    assert merged is a
    assert [d.sqs_message_id for d in merged.letters] == ["a", "bb"]
    assert [r.message_id for r in merged.acks] == ["a", "bb"]
    assert [(r.message_id, d) for r, d in merged.releases] == [("a", 1), ("bb", 1)]
    assert [(r.message_id, d) for r, d in merged.deferrals] == [("a", 2), ("bb", 2)]
    assert merged.outcomes == [(INVALID_TYPE_LABEL, "dead_lettered")] * 2
    assert [p.key for p in merged.offloaded] == ["a", "bb"]
    assert merged.dead_letter_reasons == ["invalid_json", "invalid_json"]
    assert (merged.lags, merged.contention) == ([1.0, 2.0], 5)


def test_hold_followers_orders_by_batch_position_without_sequence_numbers() -> None:
    """A FIFO group's messages without a SequenceNumber are ordered by their place in the
    batch as received (``position``): the later one waits as long as the earlier one."""
    first, second = raw("x1", note("a"), group="g"), raw("x2", note("b"), group="g")
    plan = Plan()
    plan.release(first, 0)  # listed first, but received second
    plan.defer(second, 6)
    plan.hold_followers({"x2": 0, "x1": 1})
    assert [(r.message_id, d) for r, d in plan.releases] == [("x1", 6)]
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("x2", 6)]


def test_hold_behind_skips_messages_without_a_group_and_goes_on() -> None:
    """A message without a group (sorted first) keeps its delay; the groups after it are
    still held behind their heads."""
    loose = raw("s1", note("s1"))
    head, follower = raw("x1", note("a"), group="g", seq=1), raw("x2", note("b"), group="g",
                                                                  seq=2)
    assert hold_behind([(follower, 0), (loose, 3), (head, 7)]) == [
        (follower, 7), (loose, 3), (head, 7)]


def test_triage_parses_fetched_payloads_and_labels_poison_by_its_known_type() -> None:
    from service.core.pointers import Fetched, Pointer

    pointer_body = '["software.amazon.payloadoffloading.PayloadS3Pointer", {}]'
    fetched = {"m1": Fetched(Pointer("b", "k"), note("r1").encode())}
    bad = json.dumps({"request_id": "r2", "type": "note", "payload": {"n": "x"}})
    t = triage([raw("m1", pointer_body), raw("m2", bad)], registry(), POLICY, fetched)
    [m] = t.primaries
    assert (m.request_id, m.pointer) == ("r1", Pointer("b", "k"))
    # invalid_payload of a registered type: counted under that type, not the invalid label.
    assert t.plan.outcomes == [("note", "dead_lettered")]
    assert [(d.sqs_message_id, d.reason, d.request_id) for d in t.plan.letters] == [
        ("m2", "invalid_payload", "r2")]


def test_each_contended_claim_counts() -> None:
    ms = [parsed("m1", "r1"), parsed("m2", "r2")]
    busy = {r: claim(r, status="IN_PROGRESS", sha=ms[0].payload_sha256, owner="other")
            for r in ("r1", "r2")}
    c = classify(ms, busy, POLICY, fifo=False)
    assert c.plan.contention == 2 and len(c.plan.deferrals) == 2


def test_a_reused_key_is_lettered_with_what_it_was_used_with() -> None:
    m = parsed("m1", "r1")
    c = classify([m], {"r1": claim("r1", status="COMPLETED", sha="other-sha")}, POLICY,
                 fifo=False)
    [d] = c.plan.letters
    assert (d.reason, d.error) == ("idempotency_key_reused",
                                   "request_id already used with payload_sha256=other-sha "
                                   "type=note")


def test_settle_keeps_the_pointers_of_completed_requests_and_sub_second_lags() -> None:
    from service.core.pointers import Pointer

    done, plain = parsed("m1", "r1", sent=100.0), parsed("m2", "r2")
    done.pointer = Pointer("b", "k")
    plan = settle(ApplyResult(completed=[(done, None), (plain, None)], committed_at=100.25),
                  POLICY)
    assert plan.offloaded == [Pointer("b", "k")]
    assert plan.lags == [0.25]


def test_a_failure_on_the_last_receive_sqs_allows_is_final() -> None:
    from service.core.retry import RedrivePolicy

    limit = ReceiveLimit(5)
    limit.policy = RedrivePolicy("arn:aws:sqs:us-east-1:000000000000:dlq", 9)
    last, earlier = parsed("m1", "r1", receives=9), parsed("m2", "r2", receives=8)
    plan = settle_failures([(last, "boom"), (earlier, "boom")], {"r1": 1, "r2": 1}, POLICY,
                           limit)
    assert [a.message_id for a in plan.acks] == ["m1"]
    assert [r.message_id for r, _ in plan.releases] == ["m2"]


def test_plan_unresolved_decides_every_kind_of_unread_payload() -> None:
    """Each branch, with literal expectations (POLICY: backoff(3) = 4 s, contention 2 s)."""
    from service.core.plan import plan_unresolved
    from service.core.pointers import Pointer, Refused, Unreachable
    from service.core.seams import KnownPointer

    def p(key: str) -> Pointer:
        return Pointer("b", key)

    known = {p("done").uri: KnownPointer("r-done", "note", "COMPLETED"),
             p("busy").uri: KnownPointer("r-busy", "note", "IN_PROGRESS"),
             p("done-big").uri: KnownPointer("r-big", "note", "COMPLETED")}
    refused_for = {p("denied-long").uri: 7200.4, p("denied-edge").uri: 3600.0,
                   p("denied-new").uri: 10.0, p("down-long").uri: 7200.0}
    cases: list[tuple[str, Refused | Unreachable]] = [
        # S3 failed, the request is COMPLETED: its duplicate, whatever S3 says.
        ("u-done", Unreachable(p("done"), "503", "server")),
        # S3 failed, the request still running or unknown: deferred with the backoff.
        ("u-busy", Unreachable(p("busy"), "503", "server")),
        ("u-new", Unreachable(p("new"), "timeout", "network")),
        # Refused by S3 for INGEST_S3_UNREADABLE_AFTER or longer: a dead letter.
        ("u-denied-long", Unreachable(p("denied-long"), "AccessDenied", "access_denied")),
        ("u-denied-edge", Unreachable(p("denied-edge"), "KMS", "client")),
        # Refused, not for long enough, or never counted: deferred.
        ("u-denied-new", Unreachable(p("denied-new"), "AccessDenied", "access_denied")),
        ("u-denied-uncounted", Unreachable(p("denied-x"), "AccessDenied", "access_denied")),
        # Not a refusal (S3 did not answer): deferred however long it lasts.
        ("u-down-long", Unreachable(p("down-long"), "timeout", "network")),
        # The object is gone: a duplicate of a COMPLETED request, a contention while its
        # request runs, a dead letter otherwise.
        ("r-missing-done", Refused(p("done"), "payload_object_missing", "NoSuchKey")),
        ("r-missing-busy", Refused(p("busy"), "payload_object_missing", "NoSuchKey")),
        ("r-missing-busy2", Refused(p("busy"), "payload_object_missing", "NoSuchKey")),
        ("r-missing-new", Refused(p("new"), "payload_object_missing", "NoSuchKey")),
        # Any other refusal is a dead letter, even when its pointer is known.
        ("r-big", Refused(p("done-big"), "payload_too_large", "too large")),
        ("r-envelope", Refused(None, "invalid_envelope", "not a pointer")),
    ]
    unresolved = [(raw(mid, f"body-{mid}", receives=3), r) for mid, r in cases]
    plan = plan_unresolved(unresolved, known, POLICY, refused_for, unreadable_after=3600.0)
    assert [r.message_id for r in plan.acks] == [
        "u-done", "u-denied-long", "u-denied-edge", "r-missing-done", "r-missing-new",
        "r-big", "r-envelope"]
    assert plan.outcomes == [
        ("note", "duplicate"), (INVALID_TYPE_LABEL, "dead_lettered"),
        (INVALID_TYPE_LABEL, "dead_lettered"), ("note", "duplicate"),
        (INVALID_TYPE_LABEL, "dead_lettered"), (INVALID_TYPE_LABEL, "dead_lettered"),
        (INVALID_TYPE_LABEL, "dead_lettered")]
    assert [(d.sqs_message_id, d.reason, d.error, d.body, d.request_id, d.receive_count)
            for d in plan.letters] == [
        ("u-denied-long", "payload_unreadable", "AccessDenied (refused for 7200 s since the "
         "first refusal, INGEST_S3_UNREADABLE_AFTER=3600)", "body-u-denied-long", None, 3),
        ("u-denied-edge", "payload_unreadable", "KMS (refused for 3600 s since the first "
         "refusal, INGEST_S3_UNREADABLE_AFTER=3600)", "body-u-denied-edge", None, 3),
        ("r-missing-new", "payload_object_missing", "NoSuchKey", "body-r-missing-new", None, 3),
        ("r-big", "payload_too_large", "too large", "body-r-big", None, 3),
        ("r-envelope", "invalid_envelope", "not a pointer", "body-r-envelope", None, 3)]
    assert plan.dead_letter_reasons == ["payload_unreadable", "payload_unreadable",
                                        "payload_object_missing", "payload_too_large",
                                        "invalid_envelope"]
    assert [(r.message_id, d) for r, d in plan.deferrals] == [
        ("u-busy", 4), ("u-new", 4), ("u-denied-new", 4), ("u-denied-uncounted", 4),
        ("u-down-long", 4), ("r-missing-busy", 2), ("r-missing-busy2", 2)]
    assert plan.contention == 2 and plan.releases == []


def test_plan_unresolved_without_refusal_ages_defers_every_refusal() -> None:
    from service.core.plan import plan_unresolved
    from service.core.pointers import Pointer, Unreachable

    denied = Unreachable(Pointer("b", "k"), "AccessDenied", "access_denied")
    plan = plan_unresolved([(raw("m1", "body", receives=1), denied)], {}, POLICY)
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("m1", 1)]
    assert plan.letters == [] and plan.acks == []


def test_a_followers_letter_waits_for_its_heads_commit() -> None:
    """FIFO: only the dead letters no message to apply precedes in their group are written
    before the handlers' commit (their results then leave in the group's order)."""
    def letter(mid: str, group: str | None) -> DeadLetter:
        return DeadLetter.of_received(raw(mid, "{", group=group), "invalid_json", "e")

    position = {mid: i for i, mid in enumerate(["p0", "a1", "p2", "b3", "p4", "p5"])}
    letters = [letter("p0", "g"), letter("p2", "g"), letter("p4", "h"), letter("p5", None)]
    to_apply = [parsed("a1", "r1", group="g"), parsed("b3", "r3", group="h")]
    # p0 is ahead of a1; p2 is behind a1 (same group); p4 is behind b3; p5 has no group.
    assert [d.sqs_message_id for d in letters_ahead(letters, to_apply, position)] == [
        "p0", "p5"]
    assert letters_ahead(letters, [], position) == letters


def _poison(mid: str, group: str | None) -> tuple[Received, DeadLetter]:
    r = raw(mid, "{", group=group)
    return r, DeadLetter.of_received(r, "invalid_json", "e")


def test_a_letter_behind_a_message_handed_back_is_handed_back_with_it() -> None:
    """FIFO: the poison follower of a message handed back is not dead-lettered now (its
    result would leave first): it is handed back, its counts taken out; a letter committed
    already, one ahead and one of another group stay."""
    position = {mid: i for i, mid in enumerate(["p0", "h1", "p2", "p3", "p4", "p5"])}
    plan = Plan()
    for mid, group in (("p0", "g"), ("p2", "g"), ("p3", "g"), ("p4", "k")):
        r, d = _poison(mid, group)
        plan.letter(r, d, INVALID_TYPE_LABEL)
    plan.ack(raw("p5", note("r5"), group="g"), "note", "duplicate")
    plan.release(raw("h1", note("r1"), group="g"), 7)
    plan.hold_letters(position, written={"p3"})
    assert [d.sqs_message_id for d in plan.letters] == ["p0", "p3", "p4"]
    assert [r.message_id for r in plan.acks] == ["p0", "p3", "p4", "p5"]
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("p2", 0)]
    assert plan.dead_letter_reasons == ["invalid_json"] * 3
    assert sorted(plan.outcomes) == sorted([(INVALID_TYPE_LABEL, "dead_lettered")] * 3
                                           + [("note", "duplicate")])
    plan.hold_followers(position)
    assert [(r.message_id, d) for r, d in plan.deferrals] == [("p2", 7)]  # behind h1


def test_a_message_to_apply_behind_a_late_letter_waits_for_the_next_receive() -> None:
    """FIFO: valid, poison, valid: the second valid one would commit with the first, before
    the poison's letter (written after the commit): it waits; another group does not."""
    position = {mid: i for i, mid in enumerate(["a0", "p1", "a2", "b3", "a4"])}
    a0, a2, b3 = (parsed("a0", "r0", group="g"), parsed("a2", "r2", group="g"),
                  parsed("b3", "r3", group="h"))
    a4 = parsed("a4", "r4", group="g")
    c = ClaimPlan([a0, a2, b3, a4], [], Plan())
    wait_behind_letters(c, [_poison("p1", "g")[1]], position)
    assert [m.request_id for m in c.to_apply] == ["r0", "r3"]
    assert [m.request_id for m in c.unclaim] == ["r2", "r4"]
    assert [(r.message_id, d) for r, d in c.plan.deferrals] == [("a2", 0), ("a4", 0)]
    c = ClaimPlan([a2, b3], [], Plan())  # the letter ahead of every message to apply
    wait_behind_letters(c, [_poison("p1", "g")[1]], position)
    assert [m.request_id for m in c.to_apply] == ["r2", "r3"] and not c.unclaim
