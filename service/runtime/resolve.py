"""The batch's S3 step: fetch the payloads of its pointer bodies (``service.adapters.payloads``) and
plan what could not be read (``service.core.plan.plan_unresolved``); on a FIFO queue a message
handed back here holds back the later messages of its group."""

from __future__ import annotations

from service.adapters.payloads import Later, S3Payloads
from service.core.messages import Received
from service.core.plan import Plan, plan_unresolved
from service.core.pointers import Fetched, Refused, Unreachable
from service.core.retry import RetryPolicy
from service.core.seams import StoreSeam


async def resolve_batch(
    payloads: S3Payloads | None, store: StoreSeam, policy: RetryPolicy,
    part: list[Received], fifo: bool, owner: object | None = None,
) -> tuple[list[Received], dict[str, Fetched], Plan | None, list[Received]]:
    """Fetch the payloads of a batch's pointer bodies. Returns the messages to parse as
    usual, the fetched payloads by message id, and the plan for those that could not be
    read (None when there are none), and the messages left for a later round: their
    payload did not fit the memory budget now (``owner``: the batch it is counted for).
    On a FIFO queue a message handed back or left for later here holds back the later
    messages of its group (handed back: visible again at once, behind it; or later too)."""
    if payloads is None:
        return part, {}, None, []
    resolved = await payloads.resolve(part, owner)
    if not resolved:
        return part, {}, None, []
    fetched = {k: r for k, r in resolved.items() if isinstance(r, Fetched)}
    later_ids = _later_ids(part, {k for k, r in resolved.items() if isinstance(r, Later)},
                           fifo)
    later = [m for m in part if m.message_id in later_ids]
    if later:
        part = [m for m in part if m.message_id not in later_ids]
    failed: list[tuple[Received, Refused | Unreachable]] = []
    for m in part:
        r = resolved.get(m.message_id)
        if r is not None and not isinstance(r, (Fetched, Later)):
            failed.append((m, r))
    if not failed:
        return part, fetched, None, later
    # Requests these pointers were claimed by: a missing object or an S3 failure is no
    # obstacle to acking a redelivery of a completed request as its duplicate.
    missing = [r.pointer.uri for _, r in failed if r.pointer is not None and (
        isinstance(r, Unreachable) or r.reason == "payload_object_missing")]
    # S3 refusals: the first one's time is kept in the database (restarts, fresh copies).
    refusals = {r.pointer.uri: r.error for _, r in failed
                if isinstance(r, Unreachable) and r.refused}
    refused_for = await store.note_refusals(refusals) if refusals else {}
    plan = plan_unresolved(failed, await store.known_pointers(missing) if missing else {},
                           policy, refused_for, payloads.unreadable_after)
    rest = _behind_decided(part, {m.message_id for m, _ in failed}, plan, fifo)
    return rest, fetched, plan, later


def _later_ids(part: list[Received], later_ids: set[str], fifo: bool) -> set[str]:
    """FIFO: what follows a message left for later in its group waits for it too."""
    if later_ids:
        waiting: set[str] = set()
        for m in part:
            if m.message_id in later_ids:
                if fifo and m.group_id is not None:
                    waiting.add(m.group_id)
            elif fifo and m.group_id is not None and m.group_id in waiting:
                later_ids.add(m.message_id)
    return later_ids


def _behind_decided(part: list[Received], decided: set[str], plan: Plan,
                    fifo: bool) -> list[Received]:
    """The messages of part left to parse: not decided by plan, and (FIFO) not behind a
    message of their group handed back by it (those are handed back too, at once)."""
    back = {m.message_id for m, _ in plan.deferrals}
    held: set[str] = set()
    rest = []
    for m in part:
        if m.message_id in decided:
            if fifo and m.group_id is not None and m.message_id in back:
                held.add(m.group_id)
        elif m.group_id is not None and m.group_id in held:
            plan.defer(m, 0)  # behind a message of its group handed back above
        else:
            rest.append(m)
    return rest
