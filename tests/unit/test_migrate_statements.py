from __future__ import annotations

from service.adapters.migrate import Migration, statements


def test_statements_split_only_at_semicolons_outside_quotes_and_comments() -> None:
    sql = """-- sqs-ingest: no-transaction
-- a comment; not a statement
CREATE INDEX CONCURRENTLY IF NOT EXISTS a_idx ON t (x) WHERE y <> ';' AND "we;ird" > 0;
/* block; comment */ CREATE FUNCTION f() RETURNS int AS $body$ SELECT 1; $body$ LANGUAGE sql;
SELECT 'it''s; fine';
-- trailing comment only
"""
    assert statements(sql) == [
        "-- sqs-ingest: no-transaction\n-- a comment; not a statement\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS a_idx ON t (x) WHERE y <> ';' AND \"we;ird\" > 0",
        "/* block; comment */ CREATE FUNCTION f() RETURNS int AS $body$ SELECT 1; $body$"
        " LANGUAGE sql",
        "SELECT 'it''s; fine'",
    ]


def test_only_a_first_line_marker_makes_a_migration_non_transactional() -> None:
    assert not Migration(9, "x", "-- sqs-ingest: no-transaction\nSELECT 1;\n").transactional
    assert Migration(9, "x", "SELECT 1;\n-- sqs-ingest: no-transaction\n").transactional
    assert Migration(9, "x", "CREATE TABLE x (id int);\n").transactional
