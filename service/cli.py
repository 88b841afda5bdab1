"""Argument parsing only: run, migrate, grants, gc, prune, dlq, reconcile, produce, schema,
handlers."""

from __future__ import annotations

import signal
import sys

# Nothing heavier than the lines above before main() has installed the early signal
# handlers: not even ``typing`` (tens of ms), hence the plain-constant TYPE_CHECKING. That is
# why every other import of this module is inside the function that needs it (deferred on
# purpose; the import-linter layers contract counts them all the same).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Coroutine
    from typing import Any

    from service.settings import Settings

_early_signals: list[int] = []


def _remember_signal(signum: int, _frame: object) -> None:
    _early_signals.append(signum)


EXIT_CONFIG = 2
NO_QUEUE = "http://no-queue.invalid/not-configured"
NO_DATABASE = "postgresql://no-database.invalid/not-configured"


def _parser() -> argparse.ArgumentParser:
    import argparse

    p = argparse.ArgumentParser(
        prog="sqs-ingest",
        description="Move messages from an SQS queue into PostgreSQL exactly once in effect. "
        "Configured by INGEST_* environment variables (INGEST_QUEUE_URL and "
        "INGEST_DATABASE_URL are required); see the documentation.",
    )
    from service import __version__

    p.add_argument("--version", action="version", version=f"sqs-ingest {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the daemon in the foreground")
    sub.add_parser("migrate", help="apply pending database migrations")
    _grants_parser(sub)
    sub.add_parser("gc", help="release claims of dead workers once, and print them")
    pn = sub.add_parser("prune", help="delete rows past their retention once (README "
                        "'Retention'), and print the counts per table")
    pn.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    dlq = sub.add_parser("dlq", help="inspect and replay dead letters")
    dsub = dlq.add_subparsers(dest="dlq_command", required=True)
    ls = dsub.add_parser("list", help="list dead letters")
    ls.add_argument("--reason")
    ls.add_argument("--since", help="ISO timestamp: received at or after")
    ls.add_argument("--until", help="ISO timestamp: received before")
    ls.add_argument("--include-replayed", action="store_true")
    ls.add_argument("--limit", type=int, default=100)
    ls.add_argument("--format", choices=["table", "json"], default="table")
    rp = dsub.add_parser("replay", help="send stored raw bodies back to the queue")
    g = rp.add_mutually_exclusive_group(required=True)
    g.add_argument("--id", type=int)
    g.add_argument("--all", action="store_true")
    rp.add_argument("--reason")
    rp.add_argument("--dry-run", action="store_true")
    rd = sub.add_parser("redrive", help="move the queue's own SQS dead-letter queue (its "
                        "RedrivePolicy) back to the queue, and report progress")
    rd.add_argument("--dry-run", action="store_true",
                    help="show the dead-letter queue and what would move; change nothing")
    sub.add_parser("reconcile", help="run the PySpark reconciliation (see --help)",
                   add_help=False)
    sub.add_parser("schema", help="print the JSON Schema of a message body: the envelope and "
                   "each registered type's payload model (reference handlers + INGEST_HANDLERS)")
    sub.add_parser("handlers", help="list the registered message types (reference handlers + "
                   "INGEST_HANDLERS), with their payload model and handler")
    pr = sub.add_parser("produce", help="send sample messages (dev tool)")
    pr.add_argument("--count", type=int, default=20)
    pr.add_argument("--seed", type=int, default=1)
    return p


def _grants_parser(sub: Any) -> None:
    gr = sub.add_parser("grants", help="print the SQL that grants a role what the daemon "
                        "needs: the core tables and every handler package's tables")
    gr.add_argument("--role", required=True, help="the role the daemon logs in as")
    gr.add_argument("--apply", action="store_true",
                    help="run the statements too (INGEST_DATABASE_URL as the tables' owner)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # The one place the early handlers are installed, before the heavy imports below: a
        # SIGTERM that lands while the daemon is still importing and connecting must mean
        # "stop cleanly" (exit 0), not the default "die". app.run replaces them.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _remember_signal)
    from service.secrets import safe, scrubbing_excepthook

    sys.excepthook = scrubbing_excepthook  # an unforeseen traceback: no password in it
    if argv and argv[0] == "reconcile":
        from service.reconcile.cli import main as reconcile_main

        return reconcile_main(argv[1:])
    from service.errors import ConfigError
    args = _parser().parse_args(argv)
    try:
        settings = _settings_for(args)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"sqs-ingest: {safe(line)}", file=sys.stderr)
        return EXIT_CONFIG

    from service.observe.logs import configure_logging

    configure_logging(settings.log_format, settings.log_level, trace_ids=settings.tracing)
    if args.command == "run":
        return _run(settings)
    return _command(settings, args)


def _run(settings: Settings) -> int:
    """The daemon: the handler modules imported, tracing set up if asked, app.run."""
    from service import app
    from service.ops import diagnose

    if (failed := _load_handlers(settings)) is not None:
        return failed
    from service.adapters.migrate import installed_packages
    from service.errors import ConfigError
    from service.secrets import safe

    try:
        installed_packages()  # the handler packages' migrations, checked with the schema
    except ConfigError as exc:
        print(safe(f"sqs-ingest: configuration error: {exc}"), file=sys.stderr)
        return EXIT_CONFIG
    if not settings.tracing:
        return diagnose.guard(settings, lambda: _run_async(
            app.run(settings, early_signals=_early_signals)))
    from service import __version__
    from service.observe import tracing

    try:
        tracing.setup(settings.queue_url, __version__)
    except ImportError as exc:
        print(f"sqs-ingest: configuration error: INGEST_TRACING: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return diagnose.guard(settings, lambda: _run_async(
            app.run(settings, early_signals=_early_signals)))
    finally:
        tracing.shutdown()  # flush the last spans


def _command(settings: Settings, args: argparse.Namespace) -> int:
    """Every command but run and reconcile."""
    if args.command == "migrate":
        return _run_async(_migrate(settings))
    if args.command == "gc":
        return _run_async(_gc(settings))
    if args.command == "grants":
        from service.ops import grants

        return _run_async(grants.main(settings.database_dsn, settings.database_redacted,
                                      args.role, args.apply))
    if args.command == "prune":
        from service.ops import prune_command

        return _run_async(prune_command.command(settings, args.dry_run,
                                        queue_url_set=settings.queue_url != NO_QUEUE))
    if args.command == "dlq":
        from service.ops import dlq

        return _run_async(dlq.main(settings, args))
    if args.command == "redrive":
        from service.ops import redrive

        return _run_async(redrive.main(settings, args.dry_run))
    if args.command in ("schema", "handlers"):
        return _describe(settings, args.command)
    if args.command == "produce":
        from service.ops import produce

        return _run_async(produce.main(settings, args.count, args.seed))
    raise AssertionError(args.command)


def _settings_for(args: argparse.Namespace) -> Settings:
    from service.settings import is_set, load_settings

    # migrate, gc and dlq list only need the database: a migrate Job may have no queue URL.
    # prune too: without the queue it runs only when its retentions exceed SQS's maximum.
    db_only = args.command in ("migrate", "gc", "prune", "grants") or (
        args.command == "dlq" and args.dlq_command == "list"
    )
    queue_set = is_set("queue_url")
    if db_only and not queue_set:
        return load_settings(queue_url=NO_QUEUE)
    # The database may also be given as a file (INGEST_DATABASE_URL_FILE).
    db_set = is_set("database_url", "database_url_file")
    # The placeholder database is never reached: no TLS policy for it.
    no_database = {"database_url": NO_DATABASE, "database_tls": "disable-verification"}
    if args.command in ("schema", "handlers"):  # read the registry only: no queue, no database
        return load_settings(**({} if queue_set else {"queue_url": NO_QUEUE}),
                             **({} if db_set else no_database))
    if args.command == "redrive" and not db_set:
        return load_settings(**no_database)  # SQS calls only
    return load_settings()


def _load_handlers(settings: Settings) -> int | None:
    """Import the handler packages and INGEST_HANDLERS; a failure is bad configuration: one
    line naming the package or module (exit 2)."""
    from service.handlers import HandlerConflict, HandlerLoadError, load_handler_modules
    from service.secrets import safe

    try:
        load_handler_modules(settings.handler_modules)
    except HandlerConflict as exc:
        print(safe(f"sqs-ingest: configuration error: {exc}"), file=sys.stderr)
    except HandlerLoadError as exc:
        print(safe(f"sqs-ingest: configuration error: INGEST_HANDLERS: {exc} (install the "
                   "package or module, or add its directory to PYTHONPATH)"), file=sys.stderr)
    except Exception as exc:  # any other import-time failure of user code
        print(safe(f"sqs-ingest: configuration error: INGEST_HANDLERS cannot import: "
                   f"{type(exc).__name__}: {exc}"), file=sys.stderr)
    else:
        return None
    return EXIT_CONFIG


def _describe(settings: Settings, command: str) -> int:
    """The registry the daemon would run with: reference handlers + INGEST_HANDLERS."""
    import json

    from service.handlers import default_registry, load_reference_handlers
    from service.ops import schema

    load_reference_handlers()
    if (failed := _load_handlers(settings)) is not None:
        return failed
    if command == "schema":
        print(json.dumps(schema.document(default_registry), indent=2, sort_keys=False))
    else:
        print("\n".join(schema.handler_lines(default_registry)))
    return 0


def _run_async(coro: Coroutine[Any, Any, int]) -> int:
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _migrate(settings: Settings) -> int:
    import asyncpg

    from service.adapters.migrate import migrate
    from service.errors import (
        ConfigError,
        HandlerMigrationChanged,
        MigrationBlocked,
        MigrationChanged,
    )
    from service.secrets import safe

    try:
        applied = await migrate(settings.database_dsn, settings.migrate_lock_timeout,
                                settings.migrate_attempts)
    except ConfigError as exc:
        print(safe(f"sqs-ingest: configuration error: {exc}"), file=sys.stderr)
        return EXIT_CONFIG
    except HandlerMigrationChanged as exc:
        print(safe(f"sqs-ingest: migrate refused: {exc}"), file=sys.stderr)
        return EXIT_CONFIG
    except MigrationChanged as exc:
        print(safe(f"sqs-ingest: migrate refused: {exc}"), file=sys.stderr)
        return 1
    except MigrationBlocked as exc:
        print(safe(f"sqs-ingest: migrate failed: {exc}"), file=sys.stderr)
        return 1
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        print(safe(f"sqs-ingest: migrate failed on {settings.database_redacted}: "
                   f"{type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    print(f"applied {len(applied)} migration(s)" + (
        ": " + ", ".join(m.label for m in applied) if applied else ""))
    return 0


async def _gc(settings: Settings) -> int:
    import asyncpg

    from service.adapters.store import Store, create_pool
    from service.errors import DatabaseError, driver_error
    from service.secrets import safe

    try:
        pool = await create_pool(settings.database_dsn, 2)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        print(safe(f"sqs-ingest: gc cannot connect to {settings.database_redacted}: "
                   f"{type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    try:
        store = Store(pool, worker_id="gc-cli")
        rows = await store.gc(settings.worker_lease)
    except (asyncpg.PostgresError, DatabaseError) as exc:  # the store's: DatabaseError
        print(safe(f"sqs-ingest: gc failed: {driver_error(exc)}"), file=sys.stderr)
        return 1
    finally:
        await pool.close()
    for r in rows:
        print(safe(f"released request_id={r['request_id']} owner={r['owner']} "
                   f"sqs_message_id={r['sqs_message_id']}"))
    print(f"released {len(rows)} orphaned claim(s)")
    return 0
