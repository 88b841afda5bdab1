"""The SQL mutants (tests/sql_mutants.py): each hand-written mutation of a named query must
be killed by the tests it names — a pytest run of its own (stopping at the first failure)
with the mutant injected into the query dict, on this session's PostgreSQL. Those tests
pass unmutated. ``make sql-mutation`` runs each against the whole contract + store
selection instead. Marked ``sql_mutation``: ~12 minutes on this machine, so ``make
sql-mutation`` runs them, not ``make test`` (which runs the first test below)."""

from __future__ import annotations

import pytest

from service.adapters.sql import queries
from tests.servers import Postgres
from tests.sql_mutants import EQUIVALENT, MUTANTS, run_mutant


def test_every_mutant_applies_to_exactly_one_place_and_changes_it() -> None:
    q = queries()
    for m in MUTANTS:
        assert m.apply(q[m.query]) != q[m.query], m.id
        assert m.killers, f"{m.id} names no test to kill it"
    assert not {m.id for m in MUTANTS} & set(EQUIVALENT)


@pytest.mark.sql_mutation
def test_the_killers_pass_unmutated(pg_server: Postgres) -> None:
    killers = sorted({k for m in MUTANTS for k in m.killers})
    run = run_mutant(None, killers, pg_server.port, pg_server.user)
    assert run.passed, f"{run.status}: {run.detail} without any mutant: its kills would mean nothing"


@pytest.mark.sql_mutation
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
@pytest.mark.timeout(300)
def test_sql_mutant_is_killed(mutant: object, pg_server: Postgres) -> None:
    from tests.sql_mutants import SqlMutant

    assert isinstance(mutant, SqlMutant)
    run = run_mutant(mutant, list(mutant.killers), pg_server.port, pg_server.user,
                     timeout=280)
    # Killed means a test failed: a survivor, and a hang too (a test with no bound, ended by
    # the harness' watchdog: no clean verdict), and a broken run are each a defect here.
    assert run.status == "failed", (
        f"SQL mutant {mutant.id} not killed by {list(mutant.killers)}: {run.status} {run.detail}")
