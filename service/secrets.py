"""What may reach an operator's screen or a log: database URLs and the text around them.

Three promises, one module, so every command and error path uses the same code:

* :func:`parse_dsn` reads a PostgreSQL connection string in each form secret stores hand out
  (URL with a percent-encoded or a raw generated password — ``#``, ``/``, ``?`` included —,
  the libpq ``?password=`` query form, the libpq ``key=value`` form) into a :class:`Dsn`,
  whose :meth:`Dsn.url` is the one canonical, percent-encoded URL the drivers are given.
* :func:`redact_dsn` fails closed: it prints ``scheme://user@host:port/db`` and nothing else,
  and ``<redacted>`` for anything it cannot parse.
* :func:`safe` is for any other text printed or logged (a driver's error, a row of
  ``dead_letters``): every password seen by :func:`remember` is blanked, and control / bidi
  characters are escaped (:func:`inert`), so message data cannot drive the terminal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

REDACTED = "<redacted>"
#: The connection parameters libpq knows (PostgreSQL 16 docs, 34.1.2), the only query
#: parameters a URL may carry here.
LIBPQ_PARAMETERS = frozenset("""
    host hostaddr port dbname user password passfile require_auth channel_binding
    connect_timeout client_encoding options application_name fallback_application_name
    keepalives keepalives_idle keepalives_interval keepalives_count tcp_user_timeout
    replication gssencmode sslmode requiressl sslcompression sslcert sslkey sslpassword
    sslcertmode sslrootcert sslcrl sslcrldir sslsni requirepeer ssl_min_protocol_version
    ssl_max_protocol_version krbsrvname gsslib gssdelegation service target_session_attrs
    load_balance_hosts""".split())
SCHEMES = ("postgresql", "postgres")


class DsnError(ValueError):
    """A connection string we cannot read. Its message never contains the string."""


@dataclass(frozen=True)
class Dsn:
    """A parsed connection string. ``password`` never appears in ``repr`` or :meth:`redacted`."""

    user: str
    password: str | None = field(repr=False)
    netloc: str  # host[:port], [v6]:port, or a libpq multi-host list h1:p1,h2:p2
    database: str
    query: tuple[tuple[str, str], ...] = ()
    scheme: str = "postgresql"  # postgres:// is read as the same

    def url(self) -> str:
        """The canonical URL, password percent-encoded: what asyncpg and JDBC are given."""
        auth = quote(self.user, safe="")
        if self.password is not None:
            auth += ":" + quote(self.password, safe="")
        query = "?" + urlencode(self.query) if self.query else ""
        at = auth + "@" if auth else ""
        return f"{self.scheme}://{at}{self.netloc}/{quote(self.database, safe='')}{query}"

    def with_credentials(self, user: str | None, password: str | None) -> Dsn:
        return Dsn(user if user is not None else self.user,
                   password if password is not None else self.password,
                   self.netloc, self.database, self.query, self.scheme)

    def hosts(self) -> list[str]:
        """Every host this string may connect to: the URL's host list and the ``host`` /
        ``hostaddr`` parameters (a Unix socket directory starts with ``/``)."""
        out = []
        for part in self.netloc.split(",") if self.netloc else []:
            host = part[1:part.index("]")] if part.startswith("[") else part.partition(":")[0]
            out.append(unquote(host))
        for key, value in self.query:
            if key in ("host", "hostaddr"):
                out += [h for h in value.split(",") if h]
        return out

    def redacted(self) -> str:
        """``scheme://user@host:port/db``: no password, no query (it may carry one)."""
        host = self.netloc or dict(self.query).get("host", "")
        out = f"{self.scheme}://{quote(self.user, safe='')}@{host}/{self.database}"
        # Fail closed: parts that are not plain names, or that contain the password (a
        # password misread as a host), print nothing.
        parts = out.partition("://")[2]
        if not _PLAIN.fullmatch(out) or (
                self.password and len(self.password) >= 4
                and _contains_secret(parts, self.password)):
            return REDACTED
        return out


_PLAIN = re.compile(r"[a-z]+://[\w.%~+-]*@[\w.:\[\],/-]*/[\w.$~-]*")


def _contains_secret(text: str, secret: str) -> bool:
    return any(form in text for form in _forms(secret))


def _forms(secret: str) -> set[str]:
    """The ways a secret is written: raw, percent-encoded, and decoded."""
    return {f for f in (secret, quote(secret, safe=""), quote(secret), unquote(secret)) if f}


def parse_dsn(text: str) -> Dsn:
    """A connection string in URL or libpq ``key=value`` form → :class:`Dsn` (DsnError)."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() not in SCHEMES:
            raise DsnError("must be a postgresql:// URL or a libpq key=value string")
        return _from_url(rest)
    if _KV.match(text):
        return _from_keywords(text)
    raise DsnError("must be a postgresql:// URL or a libpq key=value string")


def _from_url(rest: str) -> Dsn:
    try:
        strict = urlsplit(f"postgresql://{rest}")
        # A raw generated password cuts a URL short: at "#" (a fragment), at "/" or "?"
        # (the port becomes text, or "@" lands in the path or the query).
        well_formed = (not strict.fragment and "@" not in strict.path + strict.query
                       and (strict.port or 0) >= 0)
    except ValueError:  # a port that is not a number; a raw "[" or "]" (an IPv6 bracket)
        well_formed = False
    if well_formed:
        userinfo, _, hostpart = strict.netloc.rpartition("@")
        user, colon, password = userinfo.partition(":")
        user, pw = unquote(user), unquote(password) if colon else None
        path, query = strict.path, strict.query
    else:
        user, pw, hostpart, path, query = _split_raw(rest)
    if well_formed:
        params = parse_qsl(query.replace("+", "%2B"), keep_blank_values=True)
    else:
        params = [(k, v) for k, _, v in (p.partition("=") for p in query.split("&") if p)]
    if any(k not in LIBPQ_PARAMETERS for k, _ in params):
        # Not named: it may be the tail of a password cut at a raw "&", and drivers send
        # unknown parameters to the server, which echoes them in its error.
        raise DsnError("has a query parameter libpq does not know (percent-encode '&' in a "
                       "password)")
    keep: list[tuple[str, str]] = []
    for key, value in params:
        if key == "password":
            pw = value
        elif key == "user" and not user:
            user = value
        else:
            keep.append((key, value))
    database = unquote(path.lstrip("/"))
    if hostpart and not all(_HOST.fullmatch(h) for h in hostpart.split(",")):
        # Not a host list: a password without its "@" (it would print as a host).
        raise DsnError("has no valid host[:port]")
    if not hostpart and not any(k == "host" for k, _ in keep):
        raise DsnError("needs a host")
    return Dsn(user, pw, hostpart, database, tuple(keep))


def _split_raw(rest: str) -> tuple[str, str | None, str, str, str]:
    """(user, password, hosts, path, query) of a URL with a generated password written raw
    ("#", "/", "?", ":" unencoded), in the userinfo or in ?password=: the userinfo ends at
    the last "@" before that query parameter, the query starts at the first "?" after it;
    both are taken as written."""
    cut = min((i for i in (rest.find("?password="), rest.find("&password=")) if i >= 0),
              default=len(rest))
    at = rest.rfind("@", 0, cut)
    userinfo = rest[:at] if at >= 0 else ""
    user, colon, password = userinfo.partition(":")
    pw = password if colon else None
    if any(c in user for c in "/?#&="):  # that "@" was in the path or the query
        raise DsnError("cannot be parsed (percent-encode '@' in the path or query)")
    after = rest[at + 1:]
    hostpath, _, query = after.partition("?")
    hostpart, slash, path = hostpath.partition("/")
    if "@" in hostpath or "#" in hostpath:
        raise DsnError("cannot be parsed")
    return user, pw, hostpart, slash + path, query


_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._%-]+)(:[0-9]{1,5})?")
_KV = re.compile(r"\s*[A-Za-z_]+\s*=")
_KV_ITEM = re.compile(r"\s*([A-Za-z_]+)\s*=\s*('(?:[^'\\]|\\.)*'|[^\s']*)\s*")


def _from_keywords(text: str) -> Dsn:
    values: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _KV_ITEM.match(text, pos)
        if m is None or m.end() == pos:
            raise DsnError("cannot be parsed as key=value")
        raw = m.group(2)
        if raw.startswith("'"):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        values[m.group(1)] = raw
        pos = m.end()
    if any(k not in LIBPQ_PARAMETERS for k in values):
        # As in a URL: drivers send unknown parameters to the server (asyncpg's server
        # settings, JDBC properties such as socketFactory). Not named: it may be the tail
        # of an unquoted password.
        raise DsnError("has a parameter libpq does not know (quote a password with spaces: "
                       "password='…')")
    host = values.pop("host", "") or values.pop("hostaddr", "")
    port = values.pop("port", "")
    query = []
    if host.startswith("/"):  # a Unix socket directory is a query parameter in a URL
        query.append(("host", host))
        host = ""
    elif port and "," not in host:
        host = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    elif port:
        query.append(("port", port))
    if not host and not query:
        raise DsnError("needs a host")
    user = values.pop("user", "")
    password = values.pop("password", None)
    database = values.pop("dbname", "")
    query.extend(sorted(values.items()))
    return Dsn(user, password, host, database, tuple(query))


def redact_dsn(text: str) -> str:
    """``scheme://user@host:port/db`` of a connection string, or ``<redacted>``; never raises."""
    try:
        return inert(parse_dsn(text).redacted())
    except Exception:  # fail closed: whatever went wrong, print nothing of it
        return REDACTED


# --- passwords seen by this process, blanked wherever they would be printed -------------

_seen: set[str] = set()


def remember(secret: str | None) -> None:
    """Blank this secret (in each of its written forms) in everything :func:`scrub` sees."""
    if secret and len(secret) >= 3:  # a 1-2 character "password" would blank every line
        _seen.update(_forms(secret))


def remember_dsn(dsn: Dsn) -> None:
    """Blank the secrets a parsed connection string carries: its password and the
    ``sslpassword`` of its client key."""
    remember(dsn.password)
    remember(dict(dsn.query).get("sslpassword"))


def scrub(text: str) -> str:
    for secret in sorted(_seen, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, "***")
    return text


# --- control characters from message data ------------------------------------------------

# Every character str.isprintable() refuses: C0 and C1 controls, DEL, format characters
# (bidi overrides of Trojan Source, zero-width and invisible tag characters U+E0000-E007F,
# interlinear annotations U+FFF9-FFFB, U+180E), separators other than the space, surrogates,
# private-use and unassigned code points: nothing a message carries may drive, reorder or
# hide text on the operator's terminal.


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _json_escape(char: str) -> str:
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # JSON writes an astral character as a UTF-16 surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def inert(text: str, *, keep_lines: bool = False) -> str:
    """``text`` with every unprintable character written as ``\\xNN`` / ``\\uNNNN`` /
    ``\\UNNNNNNNN``.

    ``keep_lines`` leaves newlines and tabs alone (a traceback in the console format).
    """
    if text.isprintable():
        return text
    keep = "\n\t" if keep_lines else ""
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def inert_json(text: str) -> str:
    """JSON text with the unprintable characters JSON leaves raw (DEL, C1, format
    characters, …) written as ``\\uNNNN`` (valid JSON: such characters can only sit
    inside strings; JSON escapes C0 itself)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _json_escape(c) for c in text)


def safe(text: str) -> str:
    """Any text about to be printed or logged: known passwords blanked, controls escaped."""
    return inert(scrub(text))


def scrub_event(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: :func:`scrub` on every string of the event (nested too)."""
    if not _seen:
        return event
    return {k: _scrub_value(v) for k, v in event.items()}


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {k: _scrub_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_scrub_value(v) for v in value)
    return value


def inert_event(keep: tuple[str, ...] = ()) -> Any:
    """structlog processor for the console format: :func:`inert` on every string value
    (keys in ``keep`` keep their newlines: a rendered traceback)."""

    def processor(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        return {k: inert(v, keep_lines=k in keep) if isinstance(v, str) else v
                for k, v in event.items()}

    return processor


def scrubbing_excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """``sys.excepthook`` for the CLI: a traceback nobody foresaw, with passwords blanked
    (no locals are printed by Python's own format; exception messages may carry a DSN)."""
    import sys
    import traceback

    text = "".join(traceback.format_exception(kind, exc, tb))
    sys.stderr.write(inert(scrub(text), keep_lines=True))
