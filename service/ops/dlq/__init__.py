"""Dead letters: ``letters`` reads and replays the rows under row locks, ``sender`` sends a
body back to the queue, ``command`` is ``sqs-ingest dlq list`` / ``dlq replay`` and its output.
"""

from __future__ import annotations

from service.ops.dlq.command import main
from service.ops.dlq.letters import (
    AlreadyReplayed,
    Letter,
    NotFound,
    ReplayError,
    Send,
    SendFailed,
    find_letter,
    list_letters,
    pending,
    replay_all,
    replay_batch,
    replay_one,
)
from service.ops.dlq.sender import sqs_sender

__all__ = [
    "AlreadyReplayed",
    "Letter",
    "NotFound",
    "ReplayError",
    "Send",
    "SendFailed",
    "find_letter",
    "list_letters",
    "main",
    "pending",
    "replay_all",
    "replay_batch",
    "replay_one",
    "sqs_sender",
]
