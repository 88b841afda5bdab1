"""No output of any command carries the database password (issue 21, SPEC section 6).

Every command an operator runs — ``run``, ``migrate``, ``gc``, ``prune --dry-run``,
``dlq list``, ``dlq replay --dry-run``, ``redrive --dry-run``, ``reconcile`` — as a real
process, with the password in each form secret stores hand out (raw in the URL with
unencoded ``#`` and ``/``, ``?password=``, percent-encoded, libpq ``key=value``,
``INGEST_DATABASE_PASSWORD``, files with an RDS-managed JSON secret), against a closed
port and against a server that refuses the password. All of stdout and stderr is scanned
for the password in each way it can be written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.servers import Postgres, free_port

ROOT = Path(__file__).resolve().parents[2]
# A generated password: unencoded "#" and "/" (they cut a URL short), and a "?".
PASSWORD = "Pq7#zW/9xK?t"
# Every way the password (or a telling piece of it) can be written.
FORMS = {PASSWORD, quote(PASSWORD), quote(PASSWORD, safe=""), "zW/9x", "zW%2F9x", "Pq7#",
         "Pq7%23", "9xK?t", "9xK%3Ft"}

COMMANDS: dict[str, list[str]] = {
    "run": ["run"],
    "migrate": ["migrate"],
    "gc": ["gc"],
    "prune": ["prune", "--dry-run"],
    "dlq-list": ["dlq", "list"],
    "dlq-replay": ["dlq", "replay", "--all", "--dry-run"],
    "redrive": ["redrive", "--dry-run"],
    "reconcile": ["reconcile", "--date", "2026-01-01"],
}


def dsn_forms(host: str, port: int, user: str, tmp: Path) -> dict[str, dict[str, str]]:
    """The database settings, by form: environment variables for each."""
    url_file = tmp / "database-url"
    url_file.write_text(f"postgresql://{user}@{host}:{port}/postgres\n")
    rds_secret = tmp / "rds-secret.json"
    rds_secret.write_text(json.dumps({"username": user, "password": PASSWORD,
                                      "engine": "postgres"}))
    return {
        "url-raw": {"INGEST_DATABASE_URL": f"postgresql://{user}:{PASSWORD}@{host}:{port}/postgres"},
        "query": {"INGEST_DATABASE_URL": f"postgresql://{user}@{host}:{port}/postgres"
                                         f"?sslmode=disable&password={PASSWORD}"},
        "percent-encoded": {"INGEST_DATABASE_URL": f"postgresql://{user}:"
                                                   f"{quote(PASSWORD, safe='')}@{host}:{port}/postgres"},
        "key-value": {"INGEST_DATABASE_URL": f"host={host} port={port} user={user} "
                                             f"password='{PASSWORD}' dbname=postgres"},
        "password-env": {"INGEST_DATABASE_URL": f"postgresql://{user}@{host}:{port}/postgres",
                         "INGEST_DATABASE_PASSWORD": PASSWORD},
        "files-rds-json": {"INGEST_DATABASE_URL_FILE": str(url_file),
                           "INGEST_DATABASE_PASSWORD_FILE": str(rds_secret)},
    }


class Forker:
    """tests/first_contact/forker.py: each command in a forked child of one interpreter
    that has paid the imports (a process per command, all of fds 1 and 2 captured)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("forker.py"))], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.n = 0

    def run(self, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        """Exit code and all output. ``run`` retries an unreachable database for ever: it
        gets SIGTERM once its first retry warning is out (or exits by itself, exit 2)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.n += 1
        out = self.tmp / f"out-{self.n}.txt"
        req = {"argv": argv, "env": env, "out": str(out), "timeout": 60,
               "stop_on": "database_unavailable" if argv[0] == "run" else None}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return reply["code"], out.read_text(errors="replace")

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forker]:
    f = Forker(tmp_path_factory.mktemp("forker"))
    yield f
    f.close()


def leaked(output: str) -> set[str]:
    return {form for form in FORMS if form in output}


FORM_NAMES = ["url-raw", "query", "percent-encoded", "key-value", "password-env",
              "files-rds-json"]


@pytest.fixture
def base_env(queue_url: str, sqs_endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    return {**env, "INGEST_QUEUE_URL": queue_url, "INGEST_SQS_ENDPOINT_URL": sqs_endpoint,
            "INGEST_HTTP_PORT": "0", "INGEST_LOG_LEVEL": "debug",
            "AWS_EC2_METADATA_DISABLED": "true"}


def check(forker: Forker, base: dict[str, str], db_env: dict[str, str],
          command: str) -> tuple[int, str]:
    code, out = forker.run(COMMANDS[command], {**base, **db_env})
    assert not leaked(out), f"exit {code}, printed {leaked(out)}:\n{out}"
    # Each command got as far as the database (redrive: the queue) and said so.
    if command == "run":
        assert code in (0, 2), out  # SIGTERM during the retries, or exit 2
    else:
        assert code not in (0, None), f"succeeded:\n{out}"
    assert out.strip(), "printed nothing"
    return code, out


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("form", FORM_NAMES)
def test_closed_port(forker: Forker, base_env: dict[str, str], tmp_path: Path, form: str,
                     command: str) -> None:
    forms = dsn_forms("127.0.0.1", free_port(), "app", tmp_path)  # nothing listens there
    check(forker, {**base_env, "INGEST_LOG_FORMAT": "json"}, forms[form], command)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("form", FORM_NAMES)
def test_wrong_password(forker: Forker, base_env: dict[str, str], pg_server: Postgres,
                        password_role: str, tmp_path: Path, form: str, command: str) -> None:
    forms = dsn_forms("127.0.0.1", pg_server.port, password_role, tmp_path)
    _, out = check(forker, {**base_env, "INGEST_LOG_FORMAT": "console"}, forms[form], command)
    if command in ("run", "migrate"):  # the server did check this password and refused it
        assert "password authentication failed" in out, out


# A generated password with raw IPv6 brackets: urlsplit raised ValueError on it, which
# escaped parse_dsn (reconcile printed a traceback). Every command reads it, or refuses it
# with one line, and prints none of it.
BRACKETED = "Kx[4r]Tq#9"
BRACKETED_FORMS = {BRACKETED, quote(BRACKETED, safe=""), "Kx[4", "4r]Tq", "Kx%5B4", "r%5DTq"}


@pytest.mark.parametrize("command", COMMANDS)
def test_bracketed_password(forker: Forker, base_env: dict[str, str], command: str) -> None:
    url = f"postgresql://app:{BRACKETED}@127.0.0.1:{free_port()}/postgres"
    code, out = forker.run(COMMANDS[command], {**base_env, "INGEST_LOG_FORMAT": "json",
                                               "INGEST_DATABASE_URL": url})
    assert not {f for f in BRACKETED_FORMS if f in out}, out
    assert "Traceback" not in out and "ValueError" not in out, out
    assert code != 0 or command == "run", out
