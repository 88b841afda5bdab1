"""``moto_server`` with one FIFO fix, so the chaos suite can hold the daemon to SQS's order.

moto (5.x) redelivers a FIFO group wrongly after a visibility timeout expires: its receive
loop drops each expired message from the in-flight set one by one and skips it while the
group still looks in flight, so the *last* expired message and the ones after it come first
(1..4 in flight and expired, 5..6 queued → it delivers 4, 5, 6). SQS delivers 1..6 in order.
A killed consumer's messages expire exactly like that, so the FIFO kill -9 test would blame
the daemon for the emulator's reordering. Fix: forget expired messages before the scan.
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
    return _receive(self, queue_name, *args, **kwargs)


models.SQSBackend.receive_message = _receive_in_group_order

if __name__ == "__main__":
    main()
