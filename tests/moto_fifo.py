"""``moto_server`` with one FIFO fix, so the chaos suite can hold the daemon to SQS's order.

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


models.SQSBackend.receive_message = _receive_in_group_order  # type: ignore[method-assign]  # the patch

if __name__ == "__main__":
    main()
