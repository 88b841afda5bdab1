"""TLS to a real PostgreSQL: a CA and a server certificate (SAN localhost, 127.0.0.1) made
here, the server with ssl=on. sslmode=verify-full with the CA connects (over TLS: the
server says so), via 127.0.0.1 and via localhost; a CA that did not sign the server's
certificate is refused: `migrate` exits 1 with one line saying why."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.settings import load_settings
from tests.servers import Postgres, postgres_server

ROOT = Path(__file__).resolve().parents[2]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_server_cert(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
                     ) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    return _pem(cert), key_pem


@pytest.fixture(scope="module")
def tls_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Postgres, Path, Path]]:
    """(server with ssl=on, the CA that signed its certificate, a CA that did not)."""
    certs = tmp_path_factory.mktemp("certs")
    ca_key, ca = make_ca("sqs-ingest test CA")
    (certs / "ca.pem").write_bytes(_pem(ca))
    (certs / "other-ca.pem").write_bytes(_pem(make_ca("another CA")[1]))
    cert_pem, key_pem = make_server_cert(ca_key, ca)
    with postgres_server() as pg:
        data = Path(pg.datadir)
        (data / "server.crt").write_bytes(cert_pem)
        (data / "server.key").write_bytes(key_pem)
        os.chmod(data / "server.key", 0o600)  # PostgreSQL refuses a key others can read
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            for f in ("server.crt", "server.key"):
                os.chown(data / f, owner.pw_uid, owner.pw_gid)
        pg.stop()
        with (data / "postgresql.conf").open("a") as conf:
            conf.write("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n")
        pg.start()
        yield pg, certs / "ca.pem", certs / "other-ca.pem"


def _dsn(pg: Postgres, host: str, ca: Path) -> str:
    return (f"postgresql://{pg.user}@{host}:{pg.port}/postgres"
            f"?sslmode=verify-full&sslrootcert={ca}")


def _migrate(dsn: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INGEST_", "PG"))}
    return subprocess.run([sys.executable, "-m", "service", "migrate"], cwd=ROOT,
                          env={**env, "INGEST_DATABASE_URL": dsn}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_verify_full_connects_over_tls(tls_pg: tuple[Postgres, Path, Path],
                                             host: str) -> None:
    pg, ca, _ = tls_pg
    settings = load_settings(queue_url="http://127.0.0.1:1/q", database_url=_dsn(pg, host, ca))
    conn = await asyncpg.connect(settings.database_dsn)
    try:
        assert await conn.fetchval(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") is True
    finally:
        await conn.close()
    proc = _migrate(_dsn(pg, host, ca))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("applied "), proc.stdout


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_wrong_ca_is_refused_with_one_line(tls_pg: tuple[Postgres, Path, Path],
                                             host: str) -> None:
    pg, _, other = tls_pg
    proc = _migrate(_dsn(pg, host, other))
    assert proc.returncode == 1, proc.stderr  # README: migrate that cannot connect exits 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "certificate verify failed" in lines[0], proc.stderr
    assert lines[0].startswith("sqs-ingest: migrate failed on postgresql://"), lines[0]
    assert proc.stdout == ""
