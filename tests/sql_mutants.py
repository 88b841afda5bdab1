"""Hand-written mutations of the named SQL in service/adapters/sql/queries.sql, and the pytest
plugin that injects one: ``INGEST_TEST_SQL_MUTANT=<id> pytest -p tests.sql_mutants ...``.

``service.adapters.sql.queries()`` is cached and every module keeps the same dict (``Q =
queries()``), so the plugin edits that dict in place before any test runs: the file itself
is never touched. Each mutant names its query, the exact text it replaces (which must occur
once: a mutant that no longer applies fails the harness instead of passing unmutated) and
the tests expected to kill it (tests/integration/test_sql_mutants.py runs them)."""

from __future__ import annotations

import functools
import os
from collections.abc import Generator
from dataclasses import dataclass
from typing import IO

import pytest

from service.adapters.sql import queries
from tests.watchdog import bounded

STORE = "tests/integration/test_store.py"
CONTRACT = "tests/contract/test_store_contract.py"
PRUNE = "tests/integration/test_prune.py"
COMPLETED_AT = "tests/integration/test_completed_at.py"
RESULTS_CLAIM = "tests/integration/test_results_claim.py"

#: The suites every mutant is run against in the full mode (``make sql-mutation``).
FULL_SELECTION = [CONTRACT, STORE, PRUNE, COMPLETED_AT, RESULTS_CLAIM]


@dataclass(frozen=True)
class SqlMutant:
    id: str
    query: str
    old: str
    new: str
    killers: tuple[str, ...]  # node ids (or files) expected to fail under this mutant

    def apply(self, sql: str) -> str:
        if sql.count(self.old) != 1:
            raise AssertionError(f"mutant {self.id}: {self.old!r} occurs "
                                 f"{sql.count(self.old)} times in query {self.query}")
        return sql.replace(self.old, self.new)


M = SqlMutant
MUTANTS: list[SqlMutant] = [
    # -- claim ----------------------------------------------------------------------------
    M("claim_do_update", "claim", "ON CONFLICT (request_id) DO NOTHING",
      "ON CONFLICT (request_id) DO UPDATE SET owner = EXCLUDED.owner",
      ('tests/contract/test_store_contract.py::test_claim_duplicate_and_conflict[postgres]',)),
    M("claim_no_dead_letter_guard", "claim",
      "WHERE NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.sqs_message_id = input.sqs_message_id)",
      "",
      ('tests/integration/test_store.py::test_redelivered_dead_letter_is_not_claimed',)),
    M("claim_hash_of_input", "claim", "m.status, m.request_type, m.payload_sha256, m.owner",
      "m.status, m.request_type, i.payload_sha256, m.owner",
      ('tests/contract/test_store_contract.py::test_claim_duplicate_and_conflict[postgres]',)),
    M("claim_type_of_input", "claim", "m.status, m.request_type, m.payload_sha256, m.owner",
      "m.status, i.request_type, m.payload_sha256, m.owner",
      ('tests/contract/test_store_contract.py::test_claim_duplicate_and_conflict[postgres]',)),
    M("claim_no_failures", "claim", "coalesce(r.failures, 0) AS failures", "0 AS failures",
      ('tests/contract/test_store_contract.py::test_failure_is_isolated_counted_then_dead_lettered[postgres]',)),
    M("claim_reversed_sort", "claim", "      FROM input\n",
      "      FROM input ORDER BY request_id DESC\n",
      ('tests/contract/test_store_contract.py::test_claim_duplicate_and_conflict[postgres]',)),
    M("claim_takes_over_a_live_owner", "claim",
      "\n                          AND w.heartbeat_at >= now() - make_interval(secs => $13))", ")",
      ('tests/integration/test_store.py::test_claim_takes_over_only_claims_the_gc_would_collect_and_never_waits',
       'tests/contract/test_store_contract.py::test_claim_takes_over_a_dead_owners_claim_never_a_live_ones[postgres]')),
    M("claim_takes_over_a_stopped_owner_never", "claim", " AND w.stopped_at IS NULL", "",
      ('tests/integration/test_store.py::test_claim_takes_over_only_claims_the_gc_would_collect_and_never_waits',)),
    M("claim_takeover_waits_for_a_lock", "claim", "ORDER BY l.request_id FOR UPDATE SKIP LOCKED",
      "ORDER BY l.request_id FOR UPDATE",
      ('tests/integration/test_store.py::test_claim_takes_over_only_claims_the_gc_would_collect_and_never_waits',)),
    M("claim_held_behind_a_head_taken_over", "claim",
      "\n                      AND e.id NOT IN (SELECT id FROM stale))", ")",
      ('tests/contract/test_store_contract.py::test_fifo_head_of_a_dead_owner_is_taken_over_with_its_followers[postgres]',)),
    M("claim_takes_over_a_held_message", "claim",
      "       AND i.request_id NOT IN (SELECT request_id FROM held)\n       AND m.id IN", "       AND m.id IN",
      ('tests/contract/test_store_contract.py::test_fifo_head_of_a_dead_owner_is_taken_over_with_its_followers[postgres]',)),
    # -- fence ----------------------------------------------------------------------------
    M("fence_no_owner", "fence", " AND owner = $2", "",
      ('tests/contract/test_store_contract.py::test_completion_is_fenced_on_the_owner[postgres]',)),
    M("fence_no_status", "fence", " AND status = 'IN_PROGRESS'", "",
      ('tests/contract/test_store_contract.py::test_completion_is_fenced_on_the_owner[postgres]',)),
    M("fence_no_for_update", "fence", "   FOR UPDATE", "",
      ('tests/integration/test_store.py::test_gc_skips_a_claim_being_completed',)),
    # -- apply_entities (the reference handlers' fused statement) -------------------------
    # The token alone would do against a takeover (a new token): both go here.
    M("apply_entities_no_fence", "apply_entities",
      " AND m.claim_token = i.claim_token\n       AND m.owner = $7", "\n      ",
      ('tests/integration/test_fused_apply.py::test_a_claim_taken_over_before_the_statement_is_neither_written_nor_completed',)),
    M("apply_entities_no_token", "apply_entities", " AND m.claim_token = i.claim_token", "",
      ('tests/integration/test_fused_apply.py::test_a_claim_of_another_batch_of_this_worker_is_not_completed',)),
    M("apply_entities_no_for_update", "apply_entities", "       FOR UPDATE OF m", "",
      ('tests/integration/test_fused_apply.py::test_a_claim_taken_over_while_the_statement_waits_for_its_lock_is_not_applied',)),
    M("apply_entities_tie_applies", "apply_entities", "WHERE e.version < EXCLUDED.version",
      "WHERE e.version <= EXCLUDED.version",
      ('tests/integration/test_fused_apply.py::test_the_fused_statement_has_the_completing_transactions_effect',)),
    M("apply_entities_no_outbox", "apply_entities", "WHERE $9::boolean", "WHERE NOT $9::boolean",
      ('tests/integration/test_fused_apply.py::test_the_fused_statement_has_the_completing_transactions_effect',)),
    M("apply_entities_keeps_retries", "apply_entities", " AND r.request_id = ANY($8::text[])",
      " AND false",
      ('tests/integration/test_fused_apply.py::test_the_fused_statement_has_the_completing_transactions_effect',)),
    # -- guard_commit ---------------------------------------------------------------------
    M("guard_commit_no_close", "guard_commit", "CLOSE ALL;\n", "",
      ('tests/integration/test_commit_phase.py::test_a_deferred_constraint_one_message_violates_fails_it_alone',)),
    M("guard_commit_always_passes", "guard_commit",
      "CASE current_setting('sqs_ingest.completing', true) WHEN", "CASE 'on' WHEN",
      ('tests/integration/test_handler_boundary.py::test_a_handler_that_commits_costs_its_neighbours_nothing',)),
    # -- complete -------------------------------------------------------------------------
    M("complete_guard_kept", "complete", ", set_config('sqs_ingest.completing', 'on', true)", "",
      ('tests/contract/test_store_contract.py::test_completion_is_fenced_on_the_owner[postgres]',)),
    M("complete_with_result_guard_kept", "complete_with_result",
      ", set_config('sqs_ingest.completing', 'on', true)", "",
      ('tests/contract/test_store_contract.py::test_outbox_rows_come_with_the_outcome_only_when_results_are_on[postgres]',)),
    M("complete_no_owner", "complete", " AND m.owner = $3", "",
      ('tests/contract/test_store_contract.py::test_completion_is_fenced_on_the_owner[postgres]',)),
    M("complete_now", "complete", "completed_at = statement_timestamp()", "completed_at = now()",
      ('tests/integration/test_completed_at.py::test_completed_at_is_taken_after_the_handler',)),
    M("complete_with_result_no_owner", "complete_with_result", " AND m.owner = $3", "",
      ('tests/contract/test_store_contract.py::test_outbox_rows_come_with_the_outcome_only_when_results_are_on[postgres]',)),
    # Killed under a forced merge join / nested loop only: the hash join chosen today
    # probes with the batch's ids and keeps their order by chance (the test's comment).
    M("complete_with_result_no_order", "complete_with_result", "     ORDER BY g.n", "",
      ('tests/integration/test_results_claim.py::test_a_groups_results_leave_in_batch_order_whatever_the_join',)),
    # -- release --------------------------------------------------------------------------
    M("release_no_claim_token", "release", " AND m.claim_token = u.claim_token", "",
      ('tests/contract/test_store_contract.py::test_release_gives_back_only_this_delivery[postgres]',
       'tests/contract/test_store_contract.py::test_a_late_release_never_takes_a_later_claim_of_the_same_message[postgres]')),
    M("claim_no_token", "claim", "           sequence_number, claim_token\n",
      "           sequence_number, NULL\n",
      ('tests/contract/test_store_contract.py::test_release_gives_back_only_this_delivery[postgres]',)),
    M("release_no_owner", "release", "   AND m.owner = $2", "",
      ('tests/contract/test_store_contract.py::test_release_gives_back_only_this_delivery[postgres]', 'tests/integration/test_store.py::test_release_only_touches_this_batch_claims')),
    M("release_no_status", "release", " AND m.status = 'IN_PROGRESS'", "",
      ('tests/contract/test_store_contract.py::test_release_gives_back_only_this_delivery[postgres]', 'tests/integration/test_store.py::test_release_only_touches_this_batch_claims')),
    M("release_all_no_status", "release_all", " AND status = 'IN_PROGRESS'", "",
      ('tests/contract/test_store_contract.py::test_stop_releases_own_claims_and_marks_stopped[postgres]',)),
    # -- retry counts, dead letters -------------------------------------------------------
    M("record_failures_reset", "record_failures", "SET failures = r.failures + 1",
      "SET failures = 1",
      ('tests/contract/test_store_contract.py::test_failure_is_isolated_counted_then_dead_lettered[postgres]',)),
    M("dead_letter_do_update", "dead_letter", "ON CONFLICT (sqs_message_id) DO NOTHING",
      "ON CONFLICT (sqs_message_id) DO UPDATE SET body = EXCLUDED.body, reason = EXCLUDED.reason",
      ('tests/contract/test_store_contract.py::test_dead_letters_are_idempotent_and_byte_exact[postgres]',)),
    M("dead_letter_unsorted", "dead_letter", "\n ORDER BY 1\n", "\n",
      ('tests/integration/test_dead_letter_order.py::test_two_replicas_dead_lettering_the_same_messages_never_deadlock[False]',)),
    M("dead_letter_with_result_unsorted", "dead_letter_with_result", "\n     ORDER BY 1\n", "\n",
      ('tests/integration/test_dead_letter_order.py::test_two_replicas_dead_lettering_the_same_messages_never_deadlock[True]',)),
    M("dead_letter_with_result_reused", "dead_letter_with_result",
      " AND ins.reason <> 'idempotency_key_reused'", "",
      ('tests/contract/test_store_contract.py::test_outbox_rows_come_with_the_outcome_only_when_results_are_on[postgres]',)),
    # -- GC -------------------------------------------------------------------------------
    M("gc_lease_widened", "gc_orphans", "heartbeat_at < now() - make_interval(secs => $2)",
      "heartbeat_at < now() + make_interval(secs => $2)",
      ('tests/contract/test_store_contract.py::test_gc_releases_a_dead_owner_never_a_live_one[postgres]',)),
    M("gc_no_lease", "gc_orphans", "OR heartbeat_at < now() - make_interval(secs => $2)", "",
      ('tests/contract/test_store_contract.py::test_gc_releases_a_dead_owner_never_a_live_one[postgres]',)),
    M("gc_no_skip_locked", "gc_orphans", "FOR UPDATE SKIP LOCKED", "FOR UPDATE",
      ('tests/integration/test_store.py::test_gc_skips_a_claim_being_completed',)),
    M("gc_no_incarnation_time", "gc_orphans",
      "\n                AND started_at < (SELECT started_at FROM workers WHERE worker_id = $1)", "",
      ('tests/contract/test_store_contract.py::test_gc_of_an_earlier_incarnation_only_with_its_name[postgres]', 'tests/integration/test_store.py::test_startup_gc_releases_an_earlier_incarnation_of_the_same_name',
       'tests/integration/test_store.py::test_startup_gc_reads_the_database_clock_not_the_local_one')),
    M("gc_unknown_owner_kept", "gc_orphans",
      "\n             OR NOT EXISTS (SELECT 1 FROM workers w WHERE w.worker_id = m.owner)", "",
      ('tests/integration/test_store.py::test_gc_releases_a_claim_whose_owner_has_no_worker_row',)),
    M("gc_own_leaks_no_margin", "gc_own_leaks",
      "\n   AND received_at < now() - interval '30 seconds'", "",
      ('tests/integration/test_store.py::test_worker_lifecycle_heartbeat_stop_and_own_leaks',)),
    M("gc_own_leaks_held_too", "gc_own_leaks", " AND NOT (request_id = ANY($2::text[]))", "",
      ('tests/integration/test_store.py::test_worker_lifecycle_heartbeat_stop_and_own_leaks',)),
    M("heartbeat_stopped_too", "heartbeat", " AND stopped_at IS NULL", "",
      ('tests/integration/test_store.py::test_worker_lifecycle_heartbeat_stop_and_own_leaks',)),
    # -- outbox ---------------------------------------------------------------------------
    M("outbox_claim_no_skip_locked", "outbox_claim", "FOR UPDATE SKIP LOCKED", "FOR UPDATE",
      ('tests/integration/test_results_claim.py::test_a_held_row_is_skipped_by_the_other_publisher', 'tests/contract/test_store_contract.py::test_publishers_never_hold_the_same_row_and_keep_a_group_in_order[postgres]')),
    M("outbox_claim_published_too", "outbox_claim", "     WHERE published_at IS NULL\n",
      "     WHERE true\n",
      ('tests/contract/test_store_contract.py::test_publish_marks_only_what_the_destination_accepted[postgres]',)),
    M("outbox_claim_refused_too", "outbox_claim", "       AND refused_at IS NULL\n", "",
      ('tests/integration/test_results_refused.py::test_refused_results_do_not_block_the_later_ones[standard]',)),
    M("outbox_claim_fifo_waits_for_refused", "outbox_claim", " AND o.refused_at IS NULL\n",
      "\n",
      ('tests/integration/test_results_refused.py::test_refused_results_do_not_block_the_later_ones[fifo]',)),
    # -- retention ------------------------------------------------------------------------
    M("prune_no_dead_letter_guard", "prune_modifications",
      "AND (d.replayed_at IS NULL\n                               OR", "AND (false\n"
      "                               OR",
      ('tests/integration/test_prune.py::test_replayed_letter_of_an_old_request_is_still_a_duplicate',)),
    M("prune_dead_letters_unreplayed_too", "prune_dead_letters",
      "WHERE replayed_at < now()", "WHERE coalesce(replayed_at, '-infinity') < now()",
      ('tests/integration/test_prune.py::test_only_what_is_past_its_retention_goes',)),
    M("prune_workers_with_claims", "prune_workers",
      "\n                        AND NOT EXISTS (SELECT 1 FROM modifications m\n"
      "                                         WHERE m.owner = w.worker_id\n"
      "                                           AND m.status = 'IN_PROGRESS')", "",
      ('tests/integration/test_prune.py::test_only_what_is_past_its_retention_goes',)),
    M("prune_refusals_cutoff_flipped", "prune_payload_refusals",
      "WHERE last_refused_at < now()", "WHERE last_refused_at > now()",
      ('tests/integration/test_prune.py::test_only_what_is_past_its_retention_goes',
       'tests/integration/test_prune.py::test_a_refusal_goes_the_retention_after_its_last_refusal')),
    M("prune_refusals_from_the_first", "prune_payload_refusals",
      "WHERE last_refused_at < now()", "WHERE first_refused_at < now()",
      ('tests/integration/test_prune.py::test_a_refusal_goes_the_retention_after_its_last_refusal',)),
    M("prune_refusals_no_skip_locked", "prune_payload_refusals",
      "FOR UPDATE SKIP LOCKED", "FOR UPDATE",
      ('tests/integration/test_prune.py::test_the_refusal_pruner_skips_a_pointer_being_refused',)),
    M("prune_count_refusals_from_the_first", "prune_count_payload_refusals",
      "WHERE last_refused_at < now()", "WHERE first_refused_at < now()",
      ('tests/integration/test_prune.py::test_a_refusal_goes_the_retention_after_its_last_refusal',)),
]
del M

BY_ID = {m.id: m for m in MUTANTS}

#: Mutations tried and set aside because no test can tell them apart from the original,
#: with the reason (docs/mutation.md). Not run.
EQUIVALENT: dict[str, str] = {
    'fence_reversed_sort': (
        'every statement that waits for row locks on modifications takes them in one order (the fence is the only multi-row locker that waits; GC and prune skip locked rows), so descending instead of ascending orders all the same way: no deadlock either way'),
    'complete_no_status': (
        'complete runs on the rows the fence locked in the same transaction, checked IN_PROGRESS; nothing can change their status in between (defence in depth)'),
    'gc_completed_too': (
        "the outer DELETE repeats status = 'IN_PROGRESS': dropping the inner one only makes GC lock, not delete, completed rows (SKIP LOCKED)"),
    'prune_in_progress_too': (
        "only COMPLETED rows have a completed_at, and the deleting CTE (gone) checks status = 'COMPLETED' again"),
    'gc_not_self': (
        "the dead-owner set already excludes $1 (worker_id <> $1) and a live worker's own row exists, so its claims are never selected without the owner test either (defence in depth)"),
}


#: A hang is bounded by tests/watchdog.py, not by pytest-timeout (which stops timing a failed
#: test: ``outbox_claim_no_skip_locked``, before its tests released their holder, ran for ever;
#: measured, pytest's ``--timeout 30`` never fired), armed over each test's setup, call and
#: teardown: at its limit it
#: writes every thread's stack to the harness' file and ends the process (exit 1). It needs
#: the GIL, which a loop blocked in select (asyncpg waiting) does not hold.
WATCHDOG_SECONDS = "INGEST_TEST_SQL_WATCHDOG_SECONDS"
WATCHDOG_FILE = "INGEST_TEST_SQL_WATCHDOG_FILE"
RUNNING = "sql_mutants: running "
EXPIRED = "sql_mutants: watchdog expired in "
_watchdog: list[tuple[IO[str], float]] = []  # (its file, seconds) once configured


def pytest_configure(config: pytest.Config) -> None:
    chosen = os.environ.get("INGEST_TEST_SQL_MUTANT")
    if chosen:
        m = BY_ID[chosen]
        q = queries()  # the very dict store/prune/dlq hold as Q
        q[m.query] = m.apply(q[m.query])
    if os.environ.get(WATCHDOG_FILE):  # a run of the harness' (run_mutant)
        _watchdog.append((open(os.environ[WATCHDOG_FILE], "a", buffering=1),
                          float(os.environ[WATCHDOG_SECONDS])))


def _expire(out: IO[str], nodeid: str, seconds: float) -> None:
    import faulthandler

    out.write(f"{EXPIRED}{nodeid} after {seconds:.0f} s\n")
    out.flush()
    faulthandler.dump_traceback(out, all_threads=True)
    out.flush()
    os._exit(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    if not _watchdog:
        return (yield)
    out, seconds = _watchdog[0]
    out.write(f"{RUNNING}{item.nodeid}\n")
    with bounded(seconds, functools.partial(_expire, out, item.nodeid, seconds)):
        return (yield)


@dataclass(frozen=True)
class Run:
    """One pytest run of the harness. ``status``: ``passed`` (every test passed),
    ``failed`` (a test failed: ``detail`` names the first), ``hung`` (the watchdog or the
    run's own limit ended it: ``detail`` names the test that was running) or ``error``
    (the run itself broke — not a verdict on the mutant: ``detail`` is its output's end)."""

    status: str
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_mutant(m: SqlMutant | None, tests: list[str], pg_port: int, pg_user: str,
               timeout: float = 900, per_test: float = 90) -> Run:
    """Runs ``tests`` (stopping at the first failure) with mutant ``m`` injected (None: the
    unmutated queries) on an already running server that holds the template database. Never
    raises for what the run did and never outlives ``timeout``: a test past ``per_test``
    seconds (setup to teardown) is ended by the watchdog, the whole run past ``timeout`` is
    killed with its process group; both come back as ``hung``."""
    import re
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    env = {**os.environ, "INGEST_TEST_PG_PORT": str(pg_port), "INGEST_TEST_PG_USER": pg_user}
    env.pop("INGEST_TEST_SQL_MUTANT", None)
    if m is not None:
        env["INGEST_TEST_SQL_MUTANT"] = m.id
    with tempfile.NamedTemporaryFile("r", prefix="sql-mutant-", suffix=".log") as dog:
        env.update({WATCHDOG_FILE: dog.name, WATCHDOG_SECONDS: str(per_test)})
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "tests.sql_mutants", "-p", "no:cacheprovider",
             "-x", "-q", "-rf", "--timeout", "30", *tests],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n(the run passed its limit of {timeout:.0f} s: killed)"
        seconds = time.monotonic() - started
        watched = dog.read()
    running = [line[len(RUNNING):] for line in watched.splitlines() if line.startswith(RUNNING)]
    last = running[-1] if running else "(no test started)"
    if EXPIRED in watched:
        return Run("hung", f"{last}: no end within {per_test:.0f} s (watchdog)", seconds)
    if proc.returncode < 0 or "(the run passed its limit" in out:
        return Run("hung", f"{last}: run killed after {seconds:.0f} s", seconds)
    if proc.returncode == 0:
        return Run("passed", "", seconds)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)
    if proc.returncode == 1 and failed:
        return Run("failed", failed[0], seconds)
    return Run("error", f"pytest exit {proc.returncode}: {out[-2000:]}", seconds)


def main() -> int:
    """``python -m tests.sql_mutants [--full] [id ...]``: every (or the named) mutant against
    its killers, or with --full against the whole FULL_SELECTION; prints one line each. Exit
    0 only if every mutant was killed by a failing test: a survivor, a hang (a test without
    a bound: no clean verdict) or a broken run makes it 1."""
    import sys

    from tests.pg_for import shared_postgres

    args = sys.argv[1:]
    full = "--full" in args
    chosen = [BY_ID[a] for a in args if a != "--full"] or MUTANTS
    label = {"passed": "SURVIVED", "failed": "killed", "hung": "HUNG", "error": "ERROR"}
    counts = dict.fromkeys(label, 0)
    with shared_postgres() as pg:
        for m in chosen:
            tests = FULL_SELECTION if full or not m.killers else list(m.killers)
            run = run_mutant(m, tests, pg.port, pg.user)
            counts[run.status] += 1
            detail = run.detail if run.status != "error" else run.detail.splitlines()[0]
            print(f"{m.id:36} {label[run.status]:8} {run.seconds:6.1f}s {detail}", flush=True)
            if run.status == "error":
                print(run.detail, file=sys.stderr, flush=True)
    print(f"{counts['failed']}/{len(chosen)} killed; survived {counts['passed']}, "
          f"hung {counts['hung']}, broken runs {counts['error']}", flush=True)
    return 0 if counts["failed"] == len(chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main())
