#!/usr/bin/env python3
"""Print the SCRAM-SHA-256 verifier of a password read from stdin, for deploy/sql/roles.sql.

    scripts/scram-verifier.py < app-password.txt        # or: printf %s "$PW" | ...

PostgreSQL stores such a verifier as it is (``ALTER ROLE ... PASSWORD 'SCRAM-SHA-256$...'``):
the cleartext never reaches the server, its logs or an error's context. The format is
RFC 5802/7677's, as PostgreSQL's own ``\\password`` makes it (4096 iterations, 16-byte salt).
Standard library only; the password is read from stdin, so it stays out of ``ps``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import sys

ITERATIONS = 4096


def verifier(password: str, salt: bytes | None = None, iterations: int = ITERATIONS) -> str:
    salt = os.urandom(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


if __name__ == "__main__":
    text = sys.stdin.read().rstrip("\r\n")
    if not text:
        sys.exit("scram-verifier: no password on stdin")
    print(verifier(text))
