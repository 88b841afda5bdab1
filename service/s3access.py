"""Which S3 objects the daemon may read: the operator's allow-list (``INGEST_S3_BUCKETS``,
SPEC §6). Pure values, no I/O: settings validate with it, ``service.adapters.payloads`` applies it
before any S3 call."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

#: S3's bucket naming rule (what no bucket can be called cannot be read).
BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: The setting that names the buckets pointers may be read from.
BUCKETS_VARIABLE = "INGEST_S3_BUCKETS"


class Located(Protocol):
    @property
    def bucket(self) -> str: ...
    @property
    def key(self) -> str: ...


@dataclass(frozen=True, slots=True)
class AllowList:
    """The buckets (and key prefixes) pointers may be read from. A pointer anywhere else is
    never read, whatever the daemon's IAM role can reach: a sender who can write to the
    queue must not choose what the daemon reads and applies. Empty: no pointer is read."""

    entries: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> AllowList:
        """``bucket`` or ``bucket/prefix``, comma-separated. The prefix is literal, as in
        an IAM resource (``bucket/tenant-a/`` admits ``tenant-a/x``, not ``tenant-ab/x``).
        Raises ValueError naming the entry that is not a bucket name."""
        entries = []
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            bucket, _, prefix = item.partition("/")
            if not BUCKET_NAME.match(bucket):
                raise ValueError(f"{item!r} is not a bucket name (bucket or bucket/prefix)")
            entries.append((bucket, prefix))
        return cls(tuple(entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def admits(self, p: Located) -> bool:
        return any(p.bucket == b and p.key.startswith(prefix) for b, prefix in self.entries)

    def why_not(self, uri: str) -> str:
        """The dead letter's error for a pointer outside the list: names the variable."""
        if not self.entries:
            return f"{uri}: {BUCKETS_VARIABLE} is not set: no S3 pointer is read"
        allowed = ",".join(f"{b}/{x}" if x else b for b, x in self.entries)
        return f"{uri}: not in {BUCKETS_VARIABLE}={allowed}"[:2000]
