"""Operator output is inert: what ``dlq list`` / ``dlq replay --dry-run`` print from message
data (request ids, errors, bodies) cannot drive the terminal — control characters (ESC,
BEL, C1 CSI), and bidi overrides are escaped. JSON output stays exact data."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import asyncpg

# An OSC title change + BEL, a screen clear, a C1 CSI, a bidi override (Trojan Source).
HOSTILE = "r-\x1b]0;owned\x07\x1b[2J\x9b31m\u202egnp.exe"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_dlq_output_escapes_control_characters(database_url: str, queue_url: str,
                                               sqs_endpoint: str) -> None:
    async def seed() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(
                "INSERT INTO dead_letters (sqs_message_id, body, reason, error, request_id,"
                " request_type, receive_count) VALUES ('m-hostile', $1, 'invalid_payload', $2,"
                " $3, 'entity.upsert', 1)", "body " + HOSTILE, "error " + HOSTILE, HOSTILE)
        finally:
            await conn.close()

    asyncio.run(seed())
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_DATABASE_URL": database_url, "INGEST_QUEUE_URL": queue_url,
           "INGEST_SQS_ENDPOINT_URL": sqs_endpoint}

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "service", "dlq", *argv], env=env,
                              capture_output=True, text=True, timeout=60)

    table = cli("list")
    dry = cli("replay", "--all", "--dry-run")
    as_json = cli("list", "--format", "json")
    for res in (table, dry, as_json):
        assert res.returncode == 0, res.stderr
        out = res.stdout + res.stderr
        assert not RAW.findall(out), repr(out)
    assert "r-\\x1b]0;owned\\x07" in table.stdout  # escaped, still readable
    assert "r-\\x1b]0;owned\\x07" in dry.stdout
    (row,) = json.loads(as_json.stdout)
    assert (row["request_id"], row["error"]) == (HOSTILE, "error " + HOSTILE)  # exact data
