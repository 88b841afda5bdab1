"""The User-Agent of the daemon's AWS clients (SQS, S3, the results destination)."""

from __future__ import annotations

from typing import Any

from service import __version__


def user_agent(session: Any) -> str:
    """The User-Agent of every AWS call: ``sqs-ingest/<version>`` first (CloudTrail's
    ``userAgent`` says which requests came from the daemon), then the session's own.

    A fixed string (botocore's ``Config(user_agent=…)``) rather than botocore's default,
    which it rebuilds twice per request from the platform, the configuration and the call's
    feature ids: 2.5 % of the daemon's CPU in a profile of ``make bench`` (BENCHMARKS.md)."""
    # botocore appends the session's "extra" (aiobotocore's botocore/<version>) itself.
    own, extra = session.user_agent(), session.user_agent_extra
    if extra and own.endswith(f" {extra}"):
        own = own[: -len(extra) - 1]
    return f"sqs-ingest/{__version__} {own}"
