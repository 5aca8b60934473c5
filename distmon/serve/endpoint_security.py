"""The metrics endpoint's security settings: TLS files, mutual TLS, basic-auth users (bcrypt).

:class:`EndpointSecurity` holds the paths and loads them (before a socket is bound, so a bad
file fails start-up); :class:`BasicAuth` checks ``Authorization: Basic`` headers against an
htpasswd file of bcrypt hashes in two steps, so the server can keep bcrypt off its serving
path: :meth:`BasicAuth.screen` answers at once from what it has already verified or refused,
:meth:`BasicAuth.verify` runs bcrypt for the rest.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import os
import re
import secrets
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Union

from ..errors import logger

__all__ = ["EndpointSecurity", "BasicAuth", "Claim", "Verdict", "REALM"]

REALM = "distmon"
RELOAD_EVERY_S = 1.0  # the users file is looked at (stat) at most this often
FAILED_REMEMBERED = 4096  # recently refused credentials answered without bcrypt
_MAX_PASSWORD = 72  # bytes: bcrypt refuses longer passwords, whoever the user

# bcrypt as htpasswd -B, Apache and Go write it: $2a$, $2b$ or $2y$, cost 04-31, 53 characters
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")

PathLike = Union[str, "os.PathLike[str]"]


def option_name(name: str) -> str:
    """An option as the user may have set it.

    Example:
        >>> option_name("tls_cert")
        'tls_cert (DISTMON_TLS_CERT)'
    """
    return f"{name} (DISTMON_{name.upper()})"


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key: a hang.
    raise ValueError("the private key is encrypted; distmon needs an unencrypted key file")


@dataclass(frozen=True)
class EndpointSecurity:
    """TLS, mutual TLS and basic-auth settings of the metrics endpoint (file paths).

    ``tls_cert`` and ``tls_key`` (PEM) make the endpoint speak HTTPS (TLS 1.2 or later);
    ``tls_client_ca`` also requires clients to present a certificate signed by that CA;
    ``basic_auth_file`` holds ``user:bcrypt-hash`` lines (``htpasswd -nbB user password``).
    Construction checks which options go together; :meth:`load` reads the files, so
    everything that can fail does before a socket is bound.

    Example:
        >>> EndpointSecurity().load()
        (None, None)
        >>> EndpointSecurity(tls_cert="/etc/distmon/server.pem")
        Traceback (most recent call last):
        ...
        ValueError: distmon: tls_cert (DISTMON_TLS_CERT) needs tls_key (DISTMON_TLS_KEY) too (its private key)
    """

    tls_cert: PathLike | None = None
    tls_key: PathLike | None = None
    tls_client_ca: PathLike | None = None
    basic_auth_file: PathLike | None = None

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_client_ca", "basic_auth_file"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise TypeError(f"distmon: {option_name(name)} must be a file path, got {value!r}")
            object.__setattr__(self, name, os.fspath(value))
        if self.tls_cert is not None and self.tls_key is None:
            raise ValueError(
                f"distmon: {option_name('tls_cert')} needs {option_name('tls_key')} too (its private key)"
            )
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError(
                f"distmon: {option_name('tls_key')} needs {option_name('tls_cert')} too (its certificate)"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                f"distmon: {option_name('tls_client_ca')} needs {option_name('tls_cert')} and "
                f"{option_name('tls_key')}: client certificates are checked in the TLS handshake"
            )

    def load(self) -> tuple[ssl.SSLContext | None, BasicAuth | None]:
        """Read every file: ``(TLS context or None, BasicAuth or None)``.

        Raises ``ValueError`` naming distmon, the option and the path of what cannot be
        loaded. Basic auth without TLS works but logs a warning: passwords cross the
        network in clear text.
        """
        context = None
        if self.tls_cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_cert_chain(self.tls_cert, self.tls_key, password=_no_password)
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"distmon: tls_cert {self.tls_cert!r} / tls_key {self.tls_key!r} "
                    f"(DISTMON_TLS_CERT / DISTMON_TLS_KEY) cannot be loaded: {e} (expected PEM "
                    f"files: the certificate chain and its unencrypted private key)"
                ) from e
            if self.tls_client_ca is not None:
                try:
                    context.load_verify_locations(cafile=self.tls_client_ca)
                except OSError as e:
                    raise ValueError(
                        f"distmon: {option_name('tls_client_ca')} {self.tls_client_ca!r} cannot be "
                        f"loaded: {e} (expected PEM CA certificates)"
                    ) from e
                context.verify_mode = ssl.CERT_REQUIRED
        auth = BasicAuth.from_file(self.basic_auth_file) if self.basic_auth_file is not None else None
        if auth is not None and context is None:
            logger.warning(
                "distmon: basic_auth_file is set without tls_cert/tls_key: passwords cross the "
                "network in clear text; set DISTMON_TLS_CERT and DISTMON_TLS_KEY"
            )
        return context, auth


# --------------------------------------------------------------------------- basic auth


class Verdict(enum.Enum):
    """What a request's credentials come to."""

    ACCEPT = "accept"
    REJECT = "reject"  # 401
    UNAVAILABLE = "unavailable"  # the users file cannot be read now: everyone is refused (503)


@dataclass(frozen=True)
class _Users:
    """One reading of the users file."""

    hashes: dict[str, bytes]
    # checked for a name the file does not list: a hash at the file's highest cost that no
    # password matches, so an unknown user costs what a wrong password costs
    dummy: bytes
    stamp: tuple[int, ...]  # what stat said of the file when it was read


@dataclass(frozen=True, eq=False)
class Claim:
    """Credentials :meth:`BasicAuth.screen` could not settle: :meth:`BasicAuth.verify` runs bcrypt on them."""

    user: str
    password: bytes
    digest: bytes
    users: _Users


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read_users(path: str, bcrypt: ModuleType) -> _Users:
    """Parse an htpasswd file; ``ValueError`` naming the option, the path and the bad line."""
    where = f"{option_name('basic_auth_file')} {path!r}"
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: an editor's byte-order mark is not a name
            stamp = _stamp(os.fstat(f.fileno()))
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"distmon: {where} cannot be read: {e}; give a readable file of 'user:bcrypt-hash' lines"
        ) from e
    hashes: dict[str, bytes] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        user, sep, hashed = line.partition(":")
        if not (sep and user and _BCRYPT_HASH.fullmatch(hashed)):  # not echoed: it may hold a password
            raise ValueError(
                f"distmon: {where} line {number} is not 'user:bcrypt-hash': write it as "
                f"`htpasswd -nbB user password` prints it (a $2a$, $2b$ or $2y$ hash)"
            )
        if user in hashes:
            raise ValueError(
                f"distmon: {where} line {number}: user {user!r} is listed twice; keep one line per user"
            )
        hashes[user] = hashed.encode()
    if not hashes:
        raise ValueError(
            f"distmon: {where} is empty: expected 'user:bcrypt-hash' lines (`htpasswd -nbB user password`)"
        )
    cost = max(int(h[4:6]) for h in hashes.values())
    # a fresh salt and a digest of zeros ('.'): bcrypt computes the full cost, and the
    # result equals it with probability 2**-184
    dummy = bcrypt.gensalt(cost) + b"." * 31
    return _Users(hashes, dummy, stamp)


class BasicAuth:
    """Users and bcrypt hashes of an htpasswd file; checks ``Authorization: Basic`` headers.

    :meth:`screen` settles at once what it can: a malformed header or a refused password
    seen recently (REJECT), a password verified before (ACCEPT, remembered as an HMAC under a
    key of this process); :meth:`verify` runs bcrypt on the rest. An unknown user is checked
    against a hash at the file's highest cost, so it costs what a wrong password costs. The
    file is looked at at most once a second and re-read when it changed (what was verified
    or refused before is forgotten then); while it cannot be read, every request is
    UNAVAILABLE.

    Example:
        >>> import bcrypt, tempfile
        >>> users = tempfile.NamedTemporaryFile("w", suffix=".htpasswd", delete=False)
        >>> _ = users.write("prometheus:" + bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode() + "\\n")
        >>> users.close()
        >>> auth = BasicAuth.from_file(users.name)
        >>> header = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()
        >>> claim = auth.screen(header)
        >>> auth.verify(claim), auth.screen(header)
        (<Verdict.ACCEPT: 'accept'>, <Verdict.ACCEPT: 'accept'>)
        >>> auth.screen(None), auth.screen("Basic !!")
        (<Verdict.REJECT: 'reject'>, <Verdict.REJECT: 'reject'>)
        >>> os.unlink(users.name)
    """

    def __init__(self, path: str, bcrypt: ModuleType) -> None:
        self.path = path
        self._bcrypt = bcrypt
        self._users: _Users | None = _read_users(path, bcrypt)
        self._key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._next_look = time.monotonic() + RELOAD_EVERY_S
        self._read_at_ns = time.time_ns()
        self._verified: dict[str, bytes] = {}
        self._failed: OrderedDict[bytes, None] = OrderedDict()

    @classmethod
    def from_file(cls, path: str) -> BasicAuth:
        """Read an htpasswd file of ``user:bcrypt-hash`` lines (blank lines are skipped).

        Raises ``ValueError`` naming the option, the path and the line of what is wrong,
        or how to install ``bcrypt`` if it is missing.
        """
        try:
            import bcrypt
        except ImportError as e:
            raise ValueError(
                f"distmon: {option_name('basic_auth_file')} {path!r} needs the bcrypt package: "
                f"pip install bcrypt (or pip install 'distmon[auth]')"
            ) from e
        return cls(path, bcrypt)

    def screen(self, header: str | None) -> Verdict | Claim:
        """Settle ``header`` (an ``Authorization`` value) without bcrypt, or say what bcrypt must check."""
        scheme, _, encoded = (header or "").strip().partition(" ")
        if scheme.lower() != "basic":
            return Verdict.REJECT
        try:
            user_b, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
            user = user_b.decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return Verdict.REJECT
        if not sep or len(password) > _MAX_PASSWORD:
            return Verdict.REJECT
        digest = hmac.new(self._key, b"%d:%s%s" % (len(user_b), user_b, password), hashlib.sha256).digest()
        with self._lock:
            self._look()
            if self._users is None:
                return Verdict.UNAVAILABLE
            known = self._verified.get(user)
            if known is not None and hmac.compare_digest(known, digest):
                return Verdict.ACCEPT
            if digest in self._failed:
                self._failed.move_to_end(digest)
                return Verdict.REJECT
            return Claim(user, password, digest, self._users)

    def verify(self, claim: Claim) -> Verdict:
        """Run bcrypt on a :class:`Claim` (0.01-1 s, one core) and remember the outcome."""
        hashed = claim.users.hashes.get(claim.user)
        try:
            ok = self._bcrypt.checkpw(claim.password, hashed or claim.users.dummy) and hashed is not None
        except ValueError:
            ok = False
        with self._lock:
            if self._users is claim.users:  # not re-read in the meantime
                if ok:
                    self._verified[claim.user] = claim.digest
                else:
                    self._failed[claim.digest] = None
                    if len(self._failed) > FAILED_REMEMBERED:
                        self._failed.popitem(last=False)
        return Verdict.ACCEPT if ok else Verdict.REJECT

    def _look(self) -> None:
        """Re-read the users file if it changed (at most once per ``RELOAD_EVERY_S``); under the lock."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + RELOAD_EVERY_S
        where = f"distmon: {option_name('basic_auth_file')} {self.path!r}"
        try:
            stamp = _stamp(os.stat(self.path))
        except OSError as e:
            self._replace(None, f"{where} cannot be read: {e}")
            return
        # a file changed within the clock's granularity of our last reading may have kept its stamp
        racy = stamp[3] >= self._read_at_ns - 2_000_000_000
        if self._users is not None and stamp == self._users.stamp and not racy:
            return
        self._read_at_ns = time.time_ns()
        try:
            users = _read_users(self.path, self._bcrypt)
        except ValueError as e:
            self._replace(None, str(e))
            return
        if self._users is None or users.hashes != self._users.hashes:
            self._replace(users, f"{where} re-read")
        else:
            self._users = users  # the same users: what was verified stays verified

    def _replace(self, users: _Users | None, message: str) -> None:
        """Serve ``users`` from now on (None: refuse everyone), forgetting what was verified or refused."""
        if users is None and self._users is None:
            return  # still unreadable: said already
        self._users = users
        self._verified.clear()
        self._failed.clear()
        if users is not None:
            logger.info("%s: %d user(s)", message, len(users.hashes))
        else:
            logger.warning("%s; every request is refused (503) until it can be read", message)
