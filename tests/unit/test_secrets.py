"""service.secrets and the database secret settings: DSN forms, fail-closed redaction,
*_FILE and password overrides (RDS JSON), tracebacks without locals, inert output."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import structlog

from service import secrets
from service.observe.logs import configure_logging
from service.reconcile.parser import Args, UsageError, build_parser
from service.secrets import REDACTED, inert, parse_dsn, redact_dsn
from service.settings import ConfigError, load_settings

PW = "Pq7#zW/9xK"


@pytest.mark.parametrize("text", [
    f"postgresql://app:{PW}@db.internal:6543/ingest",
    f"postgresql://app@db.internal:6543/ingest?password={PW}",
    f"postgresql://app@db.internal:6543/ingest?password={quote(PW, safe='')}",
    f"postgresql://app:{quote(PW, safe='')}@db.internal:6543/ingest",
    f"postgres://app:{quote(PW, safe='')}@db.internal:6543/ingest",
    f"host=db.internal port=6543 user=app password='{PW}' dbname=ingest",
    f"  dbname=ingest user=app   password={PW} host=db.internal port=6543",
])
def test_every_form_reads_the_same_and_prints_no_password(text: str) -> None:
    dsn = parse_dsn(text)
    assert (dsn.user, dsn.password, dsn.netloc, dsn.database) == (
        "app", PW, "db.internal:6543", "ingest")
    assert dsn.url() == f"postgresql://app:{quote(PW, safe='')}@db.internal:6543/ingest"
    assert redact_dsn(text) == "postgresql://app@db.internal:6543/ingest"
    assert PW not in repr(dsn)


def test_query_parameters_other_than_credentials_are_kept_but_not_printed() -> None:
    text = f"postgresql://app@h/d?sslmode=require&password={PW}&application_name=x"
    dsn = parse_dsn(text)
    assert dsn.query == (("sslmode", "require"), ("application_name", "x"))
    assert redact_dsn(text) == "postgresql://app@h/d"


@pytest.mark.parametrize("text", [
    "mysql://u:s3cret-pw@h/d",           # another scheme
    "s3cret-pw",                         # not a DSN at all
    "postgresql://u:s3cret-pw",          # no host
    "postgresql://app@h/d?password=s3cret&pw",  # a raw "&" cut the password: unknown param
    "host=h password='s3cret-pw",        # unterminated quote
    "postgresql://u:s3cret-pw@h:5432x/d",  # not a port
    "postgresql://s3cret-pw:s3cret-pw/d",   # a password without its "@" is no host
])
def test_redaction_fails_closed(text: str) -> None:
    assert redact_dsn(text) == REDACTED
    with pytest.raises(secrets.DsnError) as info:
        parse_dsn(text)
    assert "s3cret" not in str(info.value)


def test_redaction_never_prints_a_part_holding_the_password() -> None:
    # A password misread as the database name (or host) prints nothing rather than it.
    dsn = secrets.Dsn("u", "verysecret", "h", "verysecret")
    assert dsn.redacted() == REDACTED


def test_control_characters_are_escaped() -> None:
    assert inert("a\x1b[2Jb\x07c\x9b1m\u202ed\ne") == "a\\x1b[2Jb\\x07c\\x9b1m\\u202ed\\x0ae"
    assert inert("x\ny\tz", keep_lines=True) == "x\ny\tz"
    assert secrets.inert_json('"a\x9bb\u2066"') == '"a\\u009bb\\u2066"'
    assert json.loads(secrets.inert_json('"a\x9bb"')) == "a\x9bb"


BASE = {"INGEST_QUEUE_URL": "http://x/q"}


def env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for k in ("INGEST_DATABASE_URL", "INGEST_DATABASE_URL_FILE", "INGEST_DATABASE_PASSWORD",
              "INGEST_DATABASE_PASSWORD_FILE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**BASE, **values}.items():
        monkeypatch.setenv(k, v)


def test_database_url_is_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    env(monkeypatch, INGEST_DATABASE_URL=f"postgresql://app:{PW}@h/d")
    s = load_settings()
    assert PW not in repr(s) and PW not in str(s) and quote(PW, safe="") not in repr(s)
    assert s.database_dsn == f"postgresql://app:{quote(PW, safe='')}@h/d"
    assert s.database_redacted == "postgresql://app@h/d"


def test_url_file_and_password_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "url").write_text("postgresql://app:old@h:5432/d\n")
    (tmp_path / "pw").write_text(PW + "\n")  # mounted secrets end in a newline
    env(monkeypatch, INGEST_DATABASE_URL_FILE=str(tmp_path / "url"),
        INGEST_DATABASE_PASSWORD_FILE=str(tmp_path / "pw"))
    assert load_settings().database_dsn == f"postgresql://app:{quote(PW, safe='')}@h:5432/d"


def test_password_overrides_every_form(monkeypatch: pytest.MonkeyPatch) -> None:
    env(monkeypatch, INGEST_DATABASE_URL="host=h user=app password=old dbname=d",
        INGEST_DATABASE_PASSWORD=PW)
    assert parse_dsn(load_settings().database_dsn).password == PW


def test_rds_managed_json_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = {"username": "rotated", "password": PW, "engine": "postgres", "port": 5432}
    (tmp_path / "s").write_text(json.dumps(secret))
    env(monkeypatch, INGEST_DATABASE_URL="postgresql://app@h/d",
        INGEST_DATABASE_PASSWORD_FILE=str(tmp_path / "s"))
    dsn = parse_dsn(load_settings().database_dsn)
    assert (dsn.user, dsn.password) == ("rotated", PW)
    env(monkeypatch, INGEST_DATABASE_URL="postgresql://app@h/d",
        INGEST_DATABASE_PASSWORD=json.dumps({"password": PW}))  # no username: URL's user
    dsn = parse_dsn(load_settings().database_dsn)
    assert (dsn.user, dsn.password) == ("app", PW)


@pytest.mark.parametrize(("values", "needle"), [
    ({"INGEST_DATABASE_URL": "postgresql://a@h/d", "INGEST_DATABASE_URL_FILE": "/x"},
     "INGEST_DATABASE_URL and INGEST_DATABASE_URL_FILE are both set"),
    ({"INGEST_DATABASE_URL_FILE": "/nonexistent/url"}, "INGEST_DATABASE_URL_FILE cannot be read"),
    ({"INGEST_DATABASE_URL": "postgresql://a@h/d", "INGEST_DATABASE_PASSWORD": "s3cret-x",
      "INGEST_DATABASE_PASSWORD_FILE": "/x"}, "INGEST_DATABASE_PASSWORD and"),
    ({"INGEST_DATABASE_URL": "postgresql://a@h/d",
      "INGEST_DATABASE_PASSWORD": '{"username": "u", "secret": "s3cret-x"}'},
     'INGEST_DATABASE_PASSWORD is a JSON object without a "password"'),
    ({"INGEST_DATABASE_URL": "mysql://a:s3cret-x@h/d"}, "INGEST_DATABASE_URL must be"),
    ({}, "INGEST_DATABASE_URL is required"),
])
def test_bad_database_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, values: dict[str, str], needle: str,
) -> None:
    env(monkeypatch, **values)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert needle in str(info.value)
    assert "s3cret" not in str(info.value)


def test_scrub_blanks_every_form_of_a_seen_password() -> None:
    secrets.remember("Zq9#tt/ww")
    text = "a Zq9#tt/ww b Zq9%23tt%2Fww c Zq9%23tt/ww"
    assert secrets.scrub(text) == "a *** b *** c ***"


def log_output(fmt: str, monkeypatch: pytest.MonkeyPatch) -> str:
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    structlog.reset_defaults()
    configure_logging(fmt, "info")
    local_dsn = "postgresql://u:LocalSecret-42@h/d"  # a local of the failing frame

    def fail() -> None:
        raise RuntimeError("boom " + local_dsn.split(":")[0])

    try:
        fail()
    except RuntimeError:
        structlog.get_logger("t").exception("failed", request_id="r\x1b[2J")
    structlog.reset_defaults()
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_carry_no_locals(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = log_output(fmt, monkeypatch)
    assert "RuntimeError" in out and "boom" in out  # the traceback is there...
    assert "LocalSecret" not in out  # ...without the frames' locals


def test_console_log_lines_are_inert(monkeypatch: pytest.MonkeyPatch) -> None:
    out = log_output("console", monkeypatch)
    assert "\x1b[2J" not in out and "r\\x1b[2J" in out


def test_log_lines_are_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets.remember("Lq7#zz/99")
    for fmt in ("json", "console"):
        buf = io.StringIO()
        monkeypatch.setattr(sys, "stderr", buf)
        structlog.reset_defaults()
        configure_logging(fmt, "info")
        structlog.get_logger("t").error("e", error="auth Lq7#zz/99 Lq7%23zz%2F99 failed")
        structlog.reset_defaults()
        assert "Lq7" not in buf.getvalue() and "***" in buf.getvalue()


def reconcile_args(*argv: str) -> Args:
    return Args(build_parser().parse_args(["--date", "2026-01-01", *argv]))


def test_reconcile_peers_from_environment_and_file(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    env(monkeypatch, INGEST_DATABASE_URL_FILE=str(tmp_path / "primary"),
        INGEST_DATABASE_PASSWORD=PW)
    (tmp_path / "primary").write_text("postgresql://app@primary/d\n")
    monkeypatch.setenv("INGEST_RECONCILE_PEER_URLS",
                       f"postgresql://app:{PW}@peer1/d\nhost=peer2 user=app password=x2x dbname=d\n")
    primary, peers = reconcile_args().databases()
    assert parse_dsn(primary).password == PW
    assert [parse_dsn(p).netloc for p in peers] == ["peer1", "peer2"]
    (tmp_path / "peers").write_text(f"# peers\npostgresql://app:{PW}@peer3/d\n")
    monkeypatch.delenv("INGEST_RECONCILE_PEER_URLS")
    monkeypatch.setenv("INGEST_RECONCILE_PEER_URLS_FILE", str(tmp_path / "peers"))
    assert [parse_dsn(p).netloc for p in reconcile_args().databases()[1]] == ["peer3"]
    monkeypatch.delenv("INGEST_RECONCILE_PEER_URLS_FILE")
    assert [parse_dsn(p).netloc for p in reconcile_args(
        "--peer-url-file", str(tmp_path / "peers")).databases()[1]] == ["peer3"]
    with pytest.raises(UsageError) as info:
        reconcile_args("--peer-url", "mysql://u:s3cret-x@h/d").databases()
    assert "s3cret" not in str(info.value) and "peer1" in str(info.value)
