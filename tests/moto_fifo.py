"""``moto_server`` with a FIFO fix (so the chaos suite can hold the daemon to SQS's order)
and locks (so it does not deliver a message twice or bring a deleted one back).

moto (5.x) redelivers a FIFO group wrongly after a visibility timeout expires: its receive
loop drops each expired message from the in-flight set one by one and skips it while the
group still looks in flight, so the *last* expired message and the ones after it come first
(1..4 in flight and expired, 5..6 queued → it delivers 4, 5, 6). SQS delivers 1..6 in order.
A killed consumer's messages expire exactly like that, so the FIFO kill -9 test would blame
the daemon for the emulator's reordering. Fix: forget expired messages before the scan.

The same happens inside one long poll: a group whose messages all expire while the poll
waits (a failed head and its followers handed back for the same delay: issue 25) is
rescanned with the expired ones dropped from the in-flight set one by one mid-scan, so the
last one goes out first. Second fix: a message received while an earlier message of its
group is still on the queue and not received with it is given back (as if not received).
"""

from __future__ import annotations

from typing import Any

from moto.server import main
from moto.sqs import models

_receive = models.SQSBackend.receive_message


def _receive_in_group_order(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> Any:
    queue = self.get_queue(queue_name)
    if queue.fifo_queue:
        for message in list(queue.pending_messages):
            if message.visible:  # visibility expired: no longer in flight
                queue.pending_messages.remove(message)
    result = _receive(self, queue_name, *args, **kwargs)
    if not queue.fifo_queue or not result:
        return result
    taken = {m.id for m in result}
    seen_groups: dict[str, bool] = {}  # group → an earlier message was left behind
    behind: set[str] = set()
    for message in list(queue._messages):  # send order
        g = message.group_id
        if message.id in taken:
            if seen_groups.get(g):
                behind.add(message.id)
        else:
            seen_groups[g] = True
    if not behind:
        return result
    for message in queue._messages:
        if message.id in behind:  # as if never received
            message.visible_at = 0
            message.approximate_receive_count -= 1
            queue.pending_messages.discard(message)
    return [m for m in result if m.id not in behind]


# Thread safety. moto_server serves requests on threads, and its SQS model mutates a queue
# without a lock: ReceiveMessage checks a message's visibility and marks it received in two
# steps (two concurrent receives can both return it: 4 of 1,000 messages, 8 receivers,
# scripts/probes/moto_double_delivery.py), and DeleteMessage rebuilds the message list (two
# concurrent deletes can bring a deleted message back: scripts/probes/moto_delete_race.py).
# Real SQS does neither at these rates. Each queue's own Condition (the one its long polls
# wait on) now guards its receive scan, deletes and visibility changes; a long poll releases
# it while it waits (Condition.wait), so it never holds up other calls.


def _locked_receive(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> Any:
    with self.get_queue(queue_name)._messages_lock:
        return _receive_in_group_order(self, queue_name, *args, **kwargs)


_delete = models.Queue.delete_message


def _locked_delete(self: Any, receipt_handle: str) -> None:
    with self._messages_lock:
        _delete(self, receipt_handle)


_change = models.SQSBackend.change_message_visibility


def _locked_change(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> Any:
    with self.get_queue(queue_name)._messages_lock:
        return _change(self, queue_name, *args, **kwargs)


# the patches
models.SQSBackend.receive_message = _locked_receive  # type: ignore[method-assign]
models.Queue.delete_message = _locked_delete  # type: ignore[method-assign]
models.SQSBackend.change_message_visibility = _locked_change  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
