"""What PostgreSQL would refuse, checked at the door: the lengths and ranges a message may
carry, so that one hostile value becomes one poison message instead of a failed batch.

A B-tree index entry must fit in about a third of a page (2,704 bytes with the default
8 kB page); text is UTF-8, up to 4 bytes per character, so an indexed string of at most
512 characters (≤ 2,048 bytes) always fits, with room for the tuple header. Use the
``IndexedText`` and ``Int64`` types in your own payload models for the same guarantee.
"""

from __future__ import annotations

import re
from typing import Annotated, overload

from pydantic import Field, StrictInt, StrictStr

#: Characters of a string stored in a unique/primary-key index (request_id, entity_id).
INDEXED_TEXT_MAX_CHARS = 512
#: Characters of a message type (not indexed, but a type name is short by nature).
TYPE_MAX_CHARS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: JSON values a body (or an S3 payload) may hold, counted before it is parsed
#: (``json_values``; ``INGEST_MAX_JSON_VALUES``). Parsed, a value costs far more than its
#: text: measured per counted value, 39 bytes of Python objects for ``[{},{},…]`` (26 times
#: the body), 46 for floats, 80 for short strings, 83 for small records, 126 for
#: ``[{"a":1.5},…]``. End to end (``sqs-ingest run``, 80 bodies at the limit received at
#: once: eight pollers of ten), ``[{"a":1.5},…]`` peaked at 1,102 MiB with 100,000 and
#: 296 MiB with 25,000 (idle: 79 MiB), inside the 512 Mi of deploy/k8s: about 2.7 MiB a
#: message, instead of up to 26 times its size (250 MiB for a 10 MiB S3 payload).
MAX_JSON_VALUES = 25_000
#: What the memory budget (``INGEST_MAX_INFLIGHT_BYTES``) charges a body for each JSON value
#: it holds, on top of its own bytes: a body's parsed objects live as long as the body,
#: until its batch ends. Between the measured costs above (39 bytes a value for ``{}``,
#: 83 for records), so a body of nested bombs is charged about 40 times its size and
#: one of ordinary records about 8.
PARSED_BYTES_PER_VALUE = 64

#: A string that fits a B-tree index entry whatever its characters.
IndexedText = Annotated[StrictStr, Field(max_length=INDEXED_TEXT_MAX_CHARS)]
#: An integer that fits PostgreSQL's ``bigint``.
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]


def json_values(text: str | bytes | bytearray) -> int:
    """An upper bound on the number of values in a JSON text, read at C speed without
    parsing it: one per ``{``, ``[`` and ``,``. Those characters inside strings count too
    (an overcount only ever refuses sooner); a scalar after ``:`` is not counted, it
    belongs to a counted object."""
    if isinstance(text, str):
        return text.count("{") + text.count("[") + text.count(",")
    return text.count(b"{") + text.count(b"[") + text.count(b",")


#: What SQS and SNS refuse in a message body or attribute: anything outside #x9 | #xA | #xD |
#: #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF (NUL, the other control characters,
#: U+FFFE, U+FFFF). A result carrying one is refused entry by entry, for ever.
_UNSENDABLE = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def unsendable(text: str) -> str | None:
    """The first character of ``text`` SQS and SNS would refuse, if any."""
    m = _UNSENDABLE.search(text)
    return m.group() if m is not None else None


def held_bytes(body: str) -> int:
    """What a received body is charged in the memory budget: its characters plus
    ``PARSED_BYTES_PER_VALUE`` for each JSON value it holds (``json_values``)."""
    return len(body) + PARSED_BYTES_PER_VALUE * json_values(body)


@overload
def storable(text: str) -> str: ...
@overload
def storable(text: None) -> None: ...
def storable(text: str | None) -> str | None:
    """PostgreSQL ``text`` cannot hold U+0000: escape it in values we only record (error
    messages, a poison message's request_id), so that recording them never fails."""
    return text.replace("\x00", "\\x00") if text is not None and "\x00" in text else text


#: U+0000 in JSON text as a serialiser writes it: ``\u0000`` after an even number of other
#: backslashes (an odd count in all). The six characters backslash-u-0-0-0-0 themselves are
#: written ``\\u0000`` (the backslash escaped): jsonb stores those.
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def json_holds_nul(encoded: bytes) -> bool:
    """Whether serialised JSON holds U+0000 in a string or key — what ``jsonb`` refuses
    ("unsupported Unicode escape sequence") — and not merely the text backslash-u0000."""
    return b"\\u0000" in encoded and _NUL_ESCAPE.search(encoded) is not None
