"""``sqs-ingest grants`` and deploy/sql/roles.sql give the daemon's role the same core-table
privileges: the command's list is compared with the file's sqs_ingest_app rows."""

from __future__ import annotations

import re
from pathlib import Path

from service.ops.grants import APP_GRANTS

ROLES_SQL = Path(__file__).resolve().parents[2] / "deploy/sql/roles.sql"
_ROW = re.compile(r"\('sqs_ingest_app',\s*'(\w+)',\s*'([A-Z, ]+)'\)")


def test_the_grants_command_and_roles_sql_agree_on_the_core_tables() -> None:
    in_file = _ROW.findall(ROLES_SQL.read_text())
    assert len(in_file) >= 10  # the pattern still finds the file's rows
    assert sorted(in_file) == sorted(APP_GRANTS)
