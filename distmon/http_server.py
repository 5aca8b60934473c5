"""The HTTP endpoint: ``/metrics`` over HTTP or HTTPS, bounded, timed out, optionally with basic auth.

prometheus_client's own WSGI app (``make_wsgi_app``) serves the registry, as in its
``start_wsgi_server``, but the server around it differs in what an always-on endpoint in a
training process needs:

- one thread waits on the listening socket and on every accepted connection that has not
  sent anything yet, so an idle connection costs a file descriptor, not a thread (the
  oldest idle one is dropped beyond ``MAX_IDLE``); a connection with bytes to read goes to
  one of at most ``max_connections`` worker threads (a few more wait in a short queue,
  the rest are closed at once);
- every connection has a deadline ``timeout_s`` after it was accepted, idle or busy, and is
  closed past it, also a client that dribbles a byte at a time (the serving thread shuts
  its socket down under the worker);
- the TLS handshake runs in the worker, under that deadline (prometheus_client wraps the
  listening socket, so its ``accept()`` does the handshake on the serving thread and one
  silent client stops the endpoint);
- HTTP basic auth against bcrypt hashes, as Prometheus' exporter web config does.

One request per connection (HTTP/1.0, as ``wsgiref``); Prometheus reconnects per scrape.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import hmac
import itertools
import os
import re
import secrets
import selectors
import socket
import socketserver
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

from .errors import ErrorCounter, logger

__all__ = ["EndpointSecurity", "BasicAuth", "MetricServer", "MAX_CONNECTIONS", "TIMEOUT_S", "MAX_IDLE"]

MAX_CONNECTIONS = 8  # requests handled at once (worker threads)
TIMEOUT_S = 10.0  # per connection, from accept to close; Prometheus' default scrape_timeout
MAX_IDLE = 64  # accepted connections waiting for their first byte
REALM = "distmon"

# bcrypt as htpasswd -B, Apache and Go write it: $2a$, $2b$ or $2y$, cost 04-31, 53 characters
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
# Checked for an unknown user name, so that it costs as much as a wrong password.
_UNKNOWN_USER_HASH = b"$2b$10$RSgx4VLcrbItJmPp8AlFXuVyO6an0T.8NEpCf8yCCIxlAIH4mHZdm"
_HTTP_TO_HTTPS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
)

PathLike = Union[str, "os.PathLike[str]"]
WSGIApp = Callable[[dict, Callable], Iterable[bytes]]


def _option(name: str) -> str:
    """An option as the user may have set it: ``tls_cert (DISTMON_TLS_CERT)``."""
    return f"{name} (DISTMON_{name.upper()})"


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key: a hang.
    raise ValueError("the private key is encrypted; distmon needs an unencrypted key file")


# --------------------------------------------------------------------------- settings


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
                raise TypeError(f"distmon: {_option(name)} must be a file path, got {value!r}")
            object.__setattr__(self, name, os.fspath(value))
        if self.tls_cert is not None and self.tls_key is None:
            raise ValueError(
                f"distmon: {_option('tls_cert')} needs {_option('tls_key')} too (its private key)"
            )
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError(
                f"distmon: {_option('tls_key')} needs {_option('tls_cert')} too (its certificate)"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                f"distmon: {_option('tls_client_ca')} needs {_option('tls_cert')} and "
                f"{_option('tls_key')}: client certificates are checked in the TLS handshake"
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
                        f"distmon: {_option('tls_client_ca')} {self.tls_client_ca!r} cannot be "
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


class BasicAuth:
    """Users and bcrypt hashes of an htpasswd file; checks ``Authorization: Basic`` headers.

    A verified password is remembered as an HMAC (under a key of this process) of user and
    password, so only the first scrape pays bcrypt (~0.1-0.3 s); a failure is not remembered,
    bcrypt runs one check at a time, and an unknown user costs what a wrong password costs.

    Example:
        >>> import bcrypt, tempfile
        >>> users = tempfile.NamedTemporaryFile("w", suffix=".htpasswd", delete=False)
        >>> _ = users.write("prometheus:" + bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode() + "\\n")
        >>> users.close()
        >>> auth = BasicAuth.from_file(users.name)
        >>> auth.check("Basic " + base64.b64encode(b"prometheus:s3cret").decode())
        True
        >>> auth.check("Basic " + base64.b64encode(b"prometheus:guess").decode()), auth.check(None)
        (False, False)
        >>> os.unlink(users.name)
    """

    def __init__(self, users: dict[str, bytes], checkpw: Callable[[bytes, bytes], bool]) -> None:
        self._users = users
        self._checkpw = checkpw
        self._key = secrets.token_bytes(32)
        self._verified: dict[str, bytes] = {}
        self._bcrypt_lock = threading.Lock()  # failed guesses use one core at most

    @classmethod
    def from_file(cls, path: str) -> BasicAuth:
        """Read an htpasswd file of ``user:bcrypt-hash`` lines (blank lines are skipped).

        Raises ``ValueError`` naming the option, the path and the line of what is wrong,
        or how to install ``bcrypt`` if it is missing.
        """
        where = f"{_option('basic_auth_file')} {path!r}"
        try:
            import bcrypt
        except ImportError as e:
            raise ValueError(
                f"distmon: {where} needs the bcrypt package: pip install bcrypt "
                f"(or pip install 'distmon[auth]')"
            ) from e
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"distmon: {where} cannot be read: {e}") from e
        users: dict[str, bytes] = {}
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue
            user, sep, hashed = line.partition(":")
            if not (
                sep and user and _BCRYPT_HASH.fullmatch(hashed)
            ):  # the line is not echoed: it may hold a password
                raise ValueError(
                    f"distmon: {where} line {number} is not 'user:bcrypt-hash' (a $2a$, $2b$ or "
                    f"$2y$ hash, as `htpasswd -nbB user password` prints)"
                )
            if user in users:
                raise ValueError(f"distmon: {where} line {number}: user {user!r} is listed twice")
            users[user] = hashed.encode()
        if not users:
            raise ValueError(
                f"distmon: {where} is empty: expected 'user:bcrypt-hash' lines "
                f"(`htpasswd -nbB user password`)"
            )
        return cls(users, bcrypt.checkpw)

    def check(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value holds a listed user and its password."""
        scheme, _, encoded = (header or "").strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user_b, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
            user = user_b.decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        if not sep:
            return False
        digest = hmac.new(self._key, b"%d:%s%s" % (len(user_b), user_b, password), hashlib.sha256).digest()
        known = self._verified.get(user)
        if known is not None and hmac.compare_digest(known, digest):
            return True
        hashed = self._users.get(user)
        with self._bcrypt_lock:
            try:
                ok = self._checkpw(password, hashed or _UNKNOWN_USER_HASH) and hashed is not None
            except ValueError:  # bcrypt refuses passwords over 72 bytes
                ok = False
        if ok:
            self._verified[user] = digest
        return ok

    def wrap(self, app: WSGIApp) -> WSGIApp:
        """``app`` behind basic auth: 401 with ``WWW-Authenticate`` unless the request's credentials check."""

        def authenticated(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if self.check(environ.get("HTTP_AUTHORIZATION")):
                return app(environ, start_response)
            start_response(
                "401 Unauthorized",
                [
                    ("WWW-Authenticate", f'Basic realm="{REALM}"'),
                    ("Content-Type", "text/plain; charset=utf-8"),
                ],
            )
            return [b"401 Unauthorized\n"]

        return authenticated


# --------------------------------------------------------------------------- server


class _Handler(WSGIRequestHandler):
    """wsgiref's request handler, without a log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _WSGIServer(WSGIServer):
    """wsgiref's server as the holder of the listening socket, the app and the WSGI environ.

    :class:`MetricServer` accepts and dispatches; only binding and ``finish_request`` (one
    request on one connection) are used from here.
    """

    request_queue_size = 128

    def __init__(self, family: socket.AddressFamily, host: str, port: int, app: WSGIApp) -> None:
        self.address_family = family
        super().__init__((host, port), _Handler)  # binds and listens; closes the socket on failure
        self.set_app(app)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        # HTTPServer would look the host up in DNS here (getfqdn), which can take seconds
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()


def _resolve(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise socket.gaierror(
            e.errno,
            f"distmon: cannot bind metrics endpoint to {addr}:{port}: {e.strerror} (DISTMON_ADDR / addr)",
        ) from e
    return family, sockaddr[0]


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)  # the client reads the end of the response, then EOF
    except OSError:
        pass
    sock.close()


def _interrupt(sock: socket.socket) -> None:
    """Wake a worker blocked on ``sock`` (another thread); the worker then closes it."""
    try:
        # the plain socket method: an SSLSocket's own shutdown() drops its TLS state first
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class MetricServer:
    """The ``/metrics`` endpoint over one registry of its own (never the global one).

    Serves prometheus_client's WSGI app (GET only; ``name[]`` filters) over HTTP, or HTTPS
    with ``security``; at most ``max_connections`` requests at once, each connection closed
    ``timeout_s`` after it was accepted.

    Example:
        >>> from prometheus_client.core import GaugeMetricFamily
        >>> class One:
        ...     def collect(self):
        ...         yield GaugeMetricFamily("demo_value", "A demo gauge.", value=1.0)
        >>> server = MetricServer.bind("127.0.0.1", 0, fallback=False)
        >>> server.attach(One())
        >>> import urllib.request
        >>> with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as r:
        ...     print([line for line in r.read().decode().splitlines() if line.startswith("demo")])
        ['demo_value 1.0']
        >>> server.close()
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        server: _WSGIServer,
        tls: ssl.SSLContext | None,
        max_connections: int,
        timeout_s: float,
    ) -> None:
        self.registry = registry
        self.addr, self.port = server.server_address[0], server.server_address[1]
        self.scheme = "https" if tls is not None else "http"
        self._server, self._tls = server, tls
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self._errors = ErrorCounter()
        self._lock = threading.Lock()
        self._workers_done = threading.Condition(self._lock)
        self._busy = 0  # worker threads running
        self._queued: deque[tuple[socket.socket, Any]] = deque()  # ready, waiting for a worker
        self._deadlines: dict[socket.socket, float] = {}  # connections handed to workers
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="distmon-http", daemon=True)
        self._thread.start()

    @classmethod
    def bind(
        cls,
        addr: str,
        port: int,
        fallback: bool,
        security: EndpointSecurity | None = None,
        *,
        tries: int = 100,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = TIMEOUT_S,
    ) -> MetricServer:
        """Load ``security``, then serve an (initially empty) registry on ``addr:port``.

        ``port`` 0 takes an ephemeral port; ``fallback`` the next free one after ``port``.
        A taken port raises ``OSError`` with ``errno.EADDRINUSE``; any other bind failure
        raises the ``OSError`` (``socket.gaierror`` for a name that does not resolve) of
        what it is; unreadable security files raise ``ValueError`` (:meth:`EndpointSecurity.load`).
        """
        tls, auth = (security or EndpointSecurity()).load()
        registry = CollectorRegistry(auto_describe=False)
        app = make_wsgi_app(registry)
        if auth is not None:
            app = auth.wrap(app)
        family, host = _resolve(addr, port)
        candidates = [port] + (list(range(port + 1, min(port + tries, 65536))) if fallback and port else [])
        last: OSError | None = None
        for p in candidates:
            try:
                server = _WSGIServer(family, host, p, app)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise OSError(
                        e.errno,
                        f"distmon: cannot bind metrics endpoint to {addr}:{p}: {e.strerror} "
                        f"(DISTMON_ADDR / addr, DISTMON_PORT / port)",
                    ) from e
                last = e
                continue
            return cls(registry, server, tls, max_connections, timeout_s)
        hint = (
            f"ports {port}-{candidates[-1]} are all in use"
            if fallback
            else f"port {port} on {addr} is already in use; pass port=0 (ephemeral), another "
            f"port (DISTMON_PORT), or port_fallback=True to take the next free one"
        )
        raise OSError(errno.EADDRINUSE, f"distmon: {hint}") from last

    def attach(self, collector: Collector) -> None:
        self.registry.register(collector)

    def close(self) -> None:
        """Stop serving and free the port; connections in flight are cut. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(b"\0")
        self._thread.join(timeout=5)
        with self._lock:
            for sock in self._deadlines:
                _interrupt(sock)
            self._deadlines.clear()
            queued = [sock for sock, _ in self._queued]
            self._queued.clear()
            self._workers_done.wait_for(lambda: self._busy == 0, timeout=5)
        for sock in queued:
            sock.close()
        self._server.server_close()
        self._wake_r.close()
        self._wake_w.close()

    # -- serving thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        listener = self._server.socket
        listener.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        idle: dict[socket.socket, tuple[Any, float]] = {}  # in accept order: the first is the oldest
        try:
            while not self._stop.is_set():
                try:
                    for key, _ in selector.select(self._next_timeout(idle)):
                        sock = key.fileobj
                        if sock is listener:
                            self._accept(listener, selector, idle)
                        elif sock is not self._wake_r:
                            selector.unregister(sock)
                            self._dispatch(sock, *idle.pop(sock))
                    self._expire(selector, idle)
                except Exception:
                    self._errors.record("the metrics endpoint's serving thread")
                    self._stop.wait(0.1)
        finally:
            for sock in idle:
                sock.close()
            selector.close()

    def _next_timeout(self, idle: dict[socket.socket, tuple[Any, float]]) -> float | None:
        deadlines = [deadline for _, deadline in itertools.islice(idle.values(), 1)]
        with self._lock:
            deadlines += self._deadlines.values()
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        idle: dict[socket.socket, tuple[Any, float]],
    ) -> None:
        while True:
            try:
                sock, client = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, say: do not spin on a readable listener
                self._stop.wait(0.1)
                return
            if len(idle) >= MAX_IDLE:
                oldest = next(iter(idle))
                selector.unregister(oldest)
                del idle[oldest]
                oldest.close()
            idle[sock] = (client, time.monotonic() + self.timeout_s)
            selector.register(sock, selectors.EVENT_READ)

    def _dispatch(self, sock: socket.socket, client: Any, deadline: float) -> None:
        with self._lock:
            if self._busy >= self.max_connections and len(self._queued) >= self.max_connections:
                sock.close()
                return
            self._deadlines[sock] = deadline
            if self._busy >= self.max_connections:
                self._queued.append((sock, client))
                return
            self._busy += 1
        try:
            threading.Thread(
                target=self._work, args=(sock, client), name="distmon-http-worker", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: drop this connection, keep the slot count right
            with self._lock:
                self._busy -= 1
                self._deadlines.pop(sock, None)
            sock.close()
            raise

    def _expire(self, selector: selectors.BaseSelector, idle: dict[socket.socket, tuple[Any, float]]) -> None:
        now = time.monotonic()
        while idle:
            sock, (_, deadline) = next(iter(idle.items()))
            if deadline > now:
                break
            selector.unregister(sock)
            del idle[sock]
            sock.close()
        with self._lock:
            for sock in [s for s, deadline in self._deadlines.items() if deadline <= now]:
                del self._deadlines[sock]
                _interrupt(sock)

    # -- workers -------------------------------------------------------------------------------
    def _work(self, sock: socket.socket, client: Any) -> None:
        while True:
            self._handle(sock, client)
            with self._lock:
                if not self._queued:
                    self._busy -= 1
                    self._workers_done.notify_all()
                    return
                sock, client = self._queued.popleft()

    def _handle(self, sock: socket.socket, client: Any) -> None:
        conn = sock
        try:
            with self._lock:
                deadline = self._deadlines.get(sock)
                if deadline is None:  # expired while queued, or the server is closing
                    return
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                if self._tls is not None:
                    # wrap_socket takes the descriptor over: re-key the deadline in the same step
                    conn = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                    self._deadlines[conn] = self._deadlines.pop(sock)
            if self._tls is not None:
                try:
                    conn.do_handshake()
                except ssl.SSLError as e:
                    if e.reason == "HTTP_REQUEST":  # say why, as Go's servers do, instead of a bare reset
                        socket.socket.sendall(conn, _HTTP_TO_HTTPS)
                    return
            self._server.finish_request(conn, client)
        except OSError:
            pass  # the client went away, failed the handshake, or ran out of time
        except Exception:
            self._errors.record("the metrics endpoint")
        finally:
            with self._lock:
                self._deadlines.pop(conn, None)
                self._deadlines.pop(sock, None)
            _close(conn)
