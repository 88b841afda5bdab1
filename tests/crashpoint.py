"""The chaos tests' crash point, installed by the test harness and never shipped: the
runtime image has no code that kills the daemon on purpose and no variable that arms it.

``python -m tests.crashpoint run`` is ``sqs-ingest run`` with one addition when
``INGEST_TEST_CRASH_AT=after_commit_before_delete`` is set (tests/acceptance/harness.Daemon
starts it so): the process kills itself (SIGKILL, as ``kill -9`` would) the first time a
batch's transaction has committed and none of its messages has been deleted yet — the
moment exactly-once exists for. The store's ``apply`` (the one commit of handler effects,
called by service.runtime.batch before it settles and deletes) is wrapped to do it. Before
dying it writes one line, ``crash_point <name>: SIGKILL (INGEST_TEST_CRASH_AT)``, to stderr,
so a test can tell that the crash happened there (tests/acceptance/test_crash_point.py).
The daemon ignores the variable (``INGEST_TEST_*`` belongs to the test harness)."""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

VARIABLE = "INGEST_TEST_CRASH_AT"
AFTER_COMMIT_BEFORE_DELETE = "after_commit_before_delete"


def install(store_class: type[Any], at: str | None) -> None:
    """Make ``store_class.apply`` SIGKILL the process once it has committed any request,
    when ``at`` names the crash point; ``None`` or empty: nothing changes."""
    if not at:
        return
    if at != AFTER_COMMIT_BEFORE_DELETE:
        raise SystemExit(f"{VARIABLE}: unknown crash point {at!r}")
    apply = store_class.apply

    @functools.wraps(apply)
    async def crashing_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        res = await apply(self, *args, **kwargs)
        if res.completed:
            os.write(2, f"crash_point {at}: SIGKILL ({VARIABLE})\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)
        return res

    store_class.apply = crashing_apply


def main() -> int:
    from service.adapters.store import Store
    from service.cli import main as cli_main

    install(Store, os.environ.get(VARIABLE))
    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
