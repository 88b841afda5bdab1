"""Every way text leaves the process passes the scrubbing and escaping of service.secrets:
standard-library log records (botocore, asyncpg, asyncio), OpenTelemetry exception events,
`reconcile`'s unforeseen tracebacks, `dlq list --format json`; parse_dsn raises nothing but
its own error; sslpassword is blanked like a password; inert() leaves nothing unprintable."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from service import secrets

ROOT = Path(__file__).resolve().parents[2]
PW = "Zq8#kV/3mW"


# --- standard-library logging -------------------------------------------------------------

STDLIB_LOGGING = textwrap.dedent("""
    import logging, sys
    from service import secrets
    from service.observe.logs import configure_logging
    configure_logging(sys.argv[1], "info")
    secrets.remember(sys.argv[2])
    dsn = "postgresql://app:" + sys.argv[2] + "@db/x"
    logging.getLogger("botocore.credentials").warning("cannot reach %s \\u202e\\x1b[2J", dsn)
    try:
        raise ConnectionError("connection to " + dsn + " refused")
    except ConnectionError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
""")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_standard_library_records_are_scrubbed_and_inert(fmt: str) -> None:
    proc = subprocess.run([sys.executable, "-c", STDLIB_LOGGING, fmt, PW], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stderr
    assert "cannot reach" in out and "ConnectionError" in out, out
    assert PW not in out and "3mW" not in out, out
    assert "\u202e" not in out and "\x1b" not in out, out
    if fmt == "json":  # the same JSON lines as the daemon's own
        lines = [json.loads(line) for line in out.splitlines()]
        assert [line["level"] for line in lines] == ["warning", "error"]
        assert lines[0]["logger"] == "botocore.credentials"


# --- OpenTelemetry exception events -------------------------------------------------------


def test_span_exception_events_are_scrubbed() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from pydantic import BaseModel

    from service.core.messages import Message, Received
    from service.observe import tracing

    class P(BaseModel):
        pass

    secrets.remember(PW)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, "http://127.0.0.1:1/000000000000/q")
    r = Received(message_id="m1", receipt_handle="h1", body="{}")
    m = Message(r, "r1", "t", P(), {}, "sha")
    try:
        with tracing.batch([r]), tracing.step("commit", [m]), tracing.handler(m):
            raise RuntimeError(f"postgresql://app:{PW}@db/x refused")
    except RuntimeError:
        pass
    finally:
        tracing.shutdown()
    texts: list[str] = []
    for span in exporter.get_finished_spans():
        texts.append(span.status.description or "")
        for event in span.events:
            texts += [str(v) for v in (event.attributes or {}).values()]
    joined = "\n".join(texts)
    assert "RuntimeError" in joined and "refused" in joined
    assert PW not in joined and "3mW" not in joined, joined


# --- reconcile: the scrubbing excepthook first --------------------------------------------


def test_reconcile_runs_under_the_scrubbing_excepthook(monkeypatch: pytest.MonkeyPatch) -> None:
    import service.reconcile.cli
    from service import cli

    seen: list[Any] = []

    def reconcile_main(argv: list[str]) -> int:
        seen.append(sys.excepthook)
        return 0

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(service.reconcile.cli, "main", reconcile_main)
    assert cli.main(["reconcile", "--date", "2026-01-01"]) == 0
    assert seen == [secrets.scrubbing_excepthook]


# --- dlq list --format json ---------------------------------------------------------------


def test_dlq_list_json_error_is_scrubbed() -> None:
    from service.ops.dlq.command import as_json
    from service.ops.dlq.letters import Letter

    secrets.remember(PW)
    body = json.dumps({"request_id": "r", "note": PW})  # message data: printed verbatim
    letter = Letter(1, "m1", body, "handler_error", f"connect postgresql://a:{PW}@h/d failed",
                    "r", "t", 1, datetime.now(UTC), None, None)
    row = as_json(letter)
    assert PW not in row["error"] and "failed" in row["error"]
    assert row["body"] == body


# --- parse_dsn raises DsnError only -------------------------------------------------------


@pytest.mark.parametrize("password", ["a[b", "a]b", "[x]", "]x[", "p[#/?]w", "[::1]", "::]"])
def test_brackets_in_a_raw_password(password: str) -> None:
    for text in (f"postgresql://app:{password}@db:5432/x",
                 f"postgresql://app@db:5432/x?password={password}",
                 f"postgresql://app:{password}@[::1]:5432/x"):
        try:
            dsn = secrets.parse_dsn(text)
        except secrets.DsnError as exc:
            assert password not in str(exc)
        else:
            assert dsn.password == password, text


def test_parse_dsn_raises_nothing_but_dsn_error() -> None:
    rng = random.Random(42)
    alphabet = "ab:/@?#&=[]%25 '\\\u202e.,0"
    for _ in range(20_000):
        middle = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        for text in (f"postgresql://{middle}", f"postgresql://u:{middle}@h/d",
                     f"host=h password={middle}", middle):
            try:
                secrets.parse_dsn(text)
            except secrets.DsnError:
                pass


# --- sslpassword --------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "postgresql://app@db/x?sslmode=verify-full&sslpassword=KeyPass-{n}",
    "host=db user=app dbname=x sslpassword='KeyPass-{n}'",
])
def test_sslpassword_is_remembered_for_blanking(text: str) -> None:
    from service.settings import resolve_database_url

    secret = f"KeyPass-{random.randrange(10**9)}"
    resolve_database_url({"database_url": text.replace("KeyPass-{n}", secret)})
    assert secrets.scrub(f"driver said {secret}") == "driver said ***"


# --- inert: every unprintable character ---------------------------------------------------


@pytest.mark.parametrize("char", ["\U000e0001", "\U000e0041", "\U000e007f", "\ufff9", "\ufffa",
                                  "\ufffb", "\u180e", "\u00a0", "\u2028", "\ue000", "\U000f0000",
                                  "\u0378", "\x85", "\x1b", "\u202e"])
def test_inert_escapes_every_unprintable_character(char: str) -> None:
    assert not char.isprintable()
    out = secrets.inert(f"a{char}b")
    assert out.isprintable() and out.startswith("a\\") and out.endswith("b"), repr(out)
    jout = secrets.inert_json(json.dumps(f"a{char}b", ensure_ascii=False))
    assert jout.isprintable() and json.loads(jout) == f"a{char}b", repr(jout)


def test_inert_keeps_printable_text_and_lines() -> None:
    text = "ünïcødé 名前 ✓ emoji 🎉"
    assert secrets.inert(text) == text
    assert secrets.inert("x\ny\tz", keep_lines=True) == "x\ny\tz"


# --- key=value DSNs: the same parameter allow-list as URLs --------------------------------


@pytest.mark.parametrize("key", ["socketFactory", "loggerFile", "search_path", "passwrd"])
def test_key_value_dsn_refuses_parameters_libpq_does_not_know(key: str) -> None:
    with pytest.raises(secrets.DsnError, match="libpq does not know"):
        secrets.parse_dsn(f"host=db user=app dbname=x {key}=/tmp/evil")
    with pytest.raises(secrets.DsnError, match="libpq does not know"):
        secrets.parse_dsn(f"postgresql://app@db/x?{key}=/tmp/evil")


def test_key_value_dsn_keeps_known_parameters() -> None:
    dsn = secrets.parse_dsn("host=db port=5433 user=app dbname=x sslmode=verify-full "
                            "sslrootcert=/etc/ssl/rds.pem application_name=ingest")
    assert dict(dsn.query) == {"sslmode": "verify-full", "sslrootcert": "/etc/ssl/rds.pem",
                               "application_name": "ingest"}
