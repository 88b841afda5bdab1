"""Runs ``sqs-ingest`` commands in forked children of one warmed-up interpreter.

Dozens of command runs each paying the CLI's imports (aiobotocore, asyncpg, pydantic: a
second or more on a loaded machine) made the output scan too slow; here the imports are
paid once and each command still runs in a process of its own, with its own environment,
whose file descriptors 1 and 2 go to a file: everything it writes is captured, whatever
writes it (print, structlog, a traceback, a library).

Protocol: one JSON request per stdin line ``{"argv", "env", "out", "stop_on", "timeout"}``;
one JSON reply per stdout line ``{"code": int}`` (``-9`` when it had to be killed).
``stop_on``: text whose appearance in the output triggers SIGTERM (``run`` retrying an
unreachable database for ever).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import service.adapters.migrate
import service.adapters.prune

# The commands' own imports, paid once here, before any fork.
import service.app
import service.cli
import service.ops.dlq
import service.ops.redrive
import service.reconcile.cli


def child(req: dict[str, object]) -> None:
    code = 1
    try:
        fd = os.open(str(req["out"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])  # type: ignore[call-overload]  # the parent sends str -> str
        try:
            # why the ignore below: the parent sends a list of str
            code = service.cli.main(list(req["argv"]))  # type: ignore[call-overload]
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as the interpreter would print it
            code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)
        deadline = time.monotonic() + float(req.get("timeout", 60))
        signalled = False
        status = None
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            if req.get("stop_on") and not signalled:
                try:
                    with open(req["out"], errors="replace") as f:
                        if req["stop_on"] in f.read():
                            os.kill(pid, signal.SIGTERM)
                            signalled = True
                except FileNotFoundError:
                    pass
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = -1
                break
            time.sleep(0.02)
        code = -9 if status == -1 else os.waitstatus_to_exitcode(status)
        print(json.dumps({"code": code}), flush=True)


if __name__ == "__main__":
    serve()
