"""The HTTP endpoint: ``/metrics`` over HTTP or HTTPS, bounded, timed out, optionally with basic auth.

prometheus_client's own WSGI app (``make_wsgi_app``) serves the registry; the server around
it is made for an always-on endpoint in a training process that slow, silent or hostile
clients can reach:

- one thread (the serving thread) holds every connection that is not being answered: it
  accepts, runs the TLS handshake, reads the request head and writes the response, none of
  it blocking, so a client that stalls at any of these costs a file descriptor and a few
  KiB, never a thread; it holds at most ``MAX_IDLE`` connections (the oldest goes first);
- a connection must have sent its whole request head (TLS handshake included, at most
  ``MAX_HEAD`` bytes) within ``header_timeout_s`` of its accept, and is closed
  ``timeout_s`` after it, answered or not;
- only a complete request reaches a worker thread (at most ``max_connections`` at once, as
  many again queue, beyond that 503 at once); workers compute responses and never touch a
  socket, so no client can hold one;
- basic auth: credentials verified before are accepted by the serving thread (an HMAC), so a
  scrape with them never waits for bcrypt; the others queue for one bcrypt thread (at most
  ``BCRYPT_QUEUE`` waiting, beyond that 503 at once), so a flood of wrong passwords delays
  only itself.

One request per connection (HTTP/1.0 responses, ``Connection: close``); Prometheus
reconnects per scrape.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import io
import re
import selectors
import socket
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

from ..errors import ErrorCounter
from .endpoint_security import REALM, BasicAuth, Claim, EndpointSecurity, Verdict

__all__ = [
    "MetricServer",
    "EndpointSecurity",
    "MAX_CONNECTIONS",
    "TIMEOUT_S",
    "HEADER_TIMEOUT_S",
    "MAX_IDLE",
    "MAX_HEAD",
    "BCRYPT_QUEUE",
]

MAX_CONNECTIONS = 8  # requests answered at once (worker threads)
TIMEOUT_S = 10.0  # per connection, from accept to close; Prometheus' default scrape_timeout
HEADER_TIMEOUT_S = 3.0  # from accept to the end of the request head, TLS handshake included
MAX_IDLE = 64  # connections the serving thread holds (handshaking, sending a head, reading an answer)
MAX_HEAD = 8192  # bytes of request line and headers
BCRYPT_QUEUE = 4  # password checks waiting for the bcrypt thread
_CHUNK = 16384  # bytes per send: at most one TLS record

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = "[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(rf"({_TOKEN}) (\S+) (HTTP/1\.[01])")
_HEADER_NAME = re.compile(_TOKEN)


def http_response(status: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    """An HTTP/1.0 response that closes the connection, with its ``Content-Length``.

    Example:
        >>> for line in http_response("404 Not Found", [("Content-Type", "text/plain")], b"no").splitlines():
        ...     print(line.decode())
        HTTP/1.0 404 Not Found
        Content-Type: text/plain
        Content-Length: 2
        Connection: close
        <BLANKLINE>
        no
    """
    lines = [f"HTTP/1.0 {status}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _text(status: str, text: str, *headers: tuple[str, str]) -> bytes:
    return http_response(status, [("Content-Type", "text/plain; charset=utf-8"), *headers], text.encode())


_BAD_REQUEST = _text("400 Bad Request", "400 Bad Request\n")
_HTTP_TO_HTTPS = _text("400 Bad Request", "Client sent an HTTP request to an HTTPS server.\n")
_HEAD_TOO_LARGE = _text("431 Request Header Fields Too Large", f"request head over {MAX_HEAD} bytes\n")
_UNAUTHORIZED = _text(
    "401 Unauthorized", "401 Unauthorized\n", ("WWW-Authenticate", f'Basic realm="{REALM}"')
)
_BUSY = _text("503 Service Unavailable", "too many requests at once: try again\n", ("Retry-After", "1"))
_NO_USERS = _text("503 Service Unavailable", "the endpoint's users file cannot be read\n")
_SERVER_ERROR = _text("500 Internal Server Error", "500 Internal Server Error\n")


def parse_head(head: bytes) -> dict[str, str] | None:
    """The CGI variables of a request head (request line and headers), or None if it is malformed.

    Header names become ``HTTP_*`` keys (repeated ones joined with commas); names with an
    underscore are dropped, as they would pose as their dashed twins.

    Example:
        >>> head = b"GET /metrics?name[]=a HTTP/1.1\\r\\nAccept: text/plain\\r\\nX-A: 1\\r\\nx-a: 2\\n\\n"
        >>> env = parse_head(head)
        >>> env["REQUEST_METHOD"], env["PATH_INFO"], env["QUERY_STRING"], env["HTTP_ACCEPT"], env["HTTP_X_A"]
        ('GET', '/metrics', 'name[]=a', 'text/plain', '1,2')
        >>> parse_head(b"hello\\r\\n\\r\\n"), parse_head(b"GET / HTTP/1.1\\r\\n folded\\r\\n\\r\\n")
        (None, None)
    """
    lines = re.split(r"\r?\n", head.decode("latin-1"))
    request = _REQUEST_LINE.fullmatch(lines[0])
    if request is None:
        return None
    method, target, version = request.groups()
    path, _, query = target.partition("?")
    env = {
        "REQUEST_METHOD": method,
        "PATH_INFO": unquote(path, "latin-1"),
        "QUERY_STRING": query,
        "SERVER_PROTOCOL": version,
    }
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not _HEADER_NAME.fullmatch(name):  # also a folded line (leading space)
            return None
        if "_" in name:
            continue
        key = name.upper().replace("-", "_")
        key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + key
        value = value.strip(" \t")
        env[key] = f"{env[key]},{value}" if key in env else value
    return env


J = TypeVar("J")  # a lane's job
Address = tuple[str, int] | tuple[str, int, int, int]  # a client's (IPv4 or IPv6) socket address


class _Lane(Generic[J]):
    """Jobs run by up to ``threads`` threads, started on demand and ended when idle; ``waiting`` more queue.

    Example:
        >>> done = []
        >>> lane = _Lane("demo", threads=1, waiting=0, run=done.append, errors=ErrorCounter())
        >>> lane.submit(1), lane.close(), done
        (True, None, [1])
    """

    def __init__(
        self, name: str, *, threads: int, waiting: int, run: Callable[[J], None], errors: ErrorCounter
    ) -> None:
        self._name, self._threads, self._waiting = name, threads, waiting
        self._run, self._errors = run, errors
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0
        self._queue: deque[J] = deque()
        self._closed = False

    def submit(self, job: J) -> bool:
        """Run ``job`` or queue it; False if the lane is full (or closed)."""
        with self._lock:
            if self._closed:
                return False
            if self._running >= self._threads:
                if len(self._queue) >= self._waiting:
                    return False
                self._queue.append(job)
                return True
            self._running += 1
        try:
            threading.Thread(target=self._loop, args=(job,), name=self._name, daemon=True).start()
        except RuntimeError:  # no thread to be had
            with self._lock:
                self._running -= 1
                self._idle.notify_all()
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Drop queued jobs and wait (up to ``timeout``) for running ones."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._idle.wait_for(lambda: self._running == 0, timeout=timeout)

    def _loop(self, job: J) -> None:
        while True:
            try:
                self._run(job)
            except Exception:
                self._errors.record(f"the metrics endpoint ({self._name})")
            with self._lock:
                if not self._queue:
                    self._running -= 1
                    self._idle.notify_all()
                    return
                job = self._queue.popleft()


class _Stage(enum.Enum):
    HANDSHAKE = "handshake"  # TLS
    HEAD = "head"  # reading the request line and headers
    BUSY = "busy"  # with a worker or the bcrypt thread
    WRITE = "write"  # sending the response


class _Conn:
    """One client connection, as the serving thread holds it."""

    def __init__(
        self, sock: socket.socket, *, client: Address, stage: _Stage, expires: float, deadline: float
    ) -> None:
        self.sock, self.client, self.stage = sock, client, stage
        self.expires = expires  # closed then: the head deadline until the head is in, then ``deadline``
        self.deadline = deadline
        self.events = selectors.EVENT_READ
        self.inbox = bytearray()
        self.outbox = b""
        self.sent = 0


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


def _listen(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _listen_waiting(family: socket.AddressFamily, host: str, port: int, deadline: float) -> socket.socket:
    """:func:`_listen`, trying a taken port again every 0.2 s until ``deadline`` (monotonic)."""
    while True:
        try:
            return _listen(family, host, port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)  # the client reads the end of the response, then EOF
    except OSError:
        pass
    sock.close()


class MetricServer:
    """The ``/metrics`` endpoint over one registry of its own (never the global one).

    Serves prometheus_client's WSGI app (GET only; ``name[]`` filters) over HTTP, or HTTPS
    with ``security``; at most ``max_connections`` requests answered at once; every
    connection closed ``header_timeout_s`` after it was accepted if its request head is not
    in by then, and ``timeout_s`` after it in any case.

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
        listener: socket.socket,
        *,
        tls: ssl.SSLContext | None,
        auth: BasicAuth | None,
        max_connections: int,
        timeout_s: float,
        header_timeout_s: float,
    ) -> None:
        self.registry = registry
        self.addr, self.port = listener.getsockname()[:2]
        self.scheme = "https" if tls is not None else "http"
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self.header_timeout_s = min(header_timeout_s, timeout_s)
        self._app = make_wsgi_app(registry)
        self._listener, self._tls, self._auth = listener, tls, auth
        self._errors = ErrorCounter()
        self.scrapes = 0  # metrics answered with 200 (the linger waits for the final state's)
        self._scraped = threading.Condition()
        self._workers = _Lane(
            "distmon-http-worker",
            threads=max_connections,
            waiting=max_connections,
            run=self._answer,
            errors=self._errors,
        )
        self._bcrypt = _Lane(
            "distmon-http-bcrypt", threads=1, waiting=BCRYPT_QUEUE, run=self._check, errors=self._errors
        )
        # the serving thread's own: connections it holds, oldest first, and those with a lane
        self._held: dict[_Conn, None] = {}
        self._busy: set[_Conn] = set()
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._answered: deque[tuple[_Conn, bytes]] = deque()  # by the lanes, for the serving thread
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
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
        wait_s: float = 0.0,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = TIMEOUT_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> MetricServer:
        """Load ``security``, then serve an (initially empty) registry on ``addr:port``.

        ``port`` 0 takes an ephemeral port; ``fallback`` the next free one after ``port`` (of
        ``tries``), else an ephemeral one. ``wait_s``: while ``port`` is taken, try it again for
        this long first (a restarted worker, its predecessor's socket on the way out).
        ``timeout_s`` bounds a connection's life from its accept, ``header_timeout_s`` (at
        most ``timeout_s``) the time until its request head is in. A taken port raises
        ``OSError`` with ``errno.EADDRINUSE``; any other bind failure
        raises the ``OSError`` (``socket.gaierror`` for a name that does not resolve) of
        what it is; unreadable security files raise ``ValueError`` (:meth:`EndpointSecurity.load`).
        """
        tls, auth = (security or EndpointSecurity()).load()
        family, host = _resolve(addr, port)
        # the next ports, then an ephemeral one: with fallback a taken port never fails the job
        candidates = [port] + (
            list(range(port + 1, min(port + tries, 65536))) + [0] if fallback and port else []
        )
        last: OSError | None = None
        deadline = time.monotonic() + wait_s
        for p in candidates:
            try:
                listener = _listen_waiting(family, host, p, deadline if p == port else 0.0)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise OSError(
                        e.errno,
                        f"distmon: cannot bind metrics endpoint to {addr}:{p}: {e.strerror} "
                        f"(DISTMON_ADDR / addr, DISTMON_PORT / port)",
                    ) from e
                last = e
                continue
            registry = CollectorRegistry(auto_describe=False)
            return cls(
                registry,
                listener,
                tls=tls,
                auth=auth,
                max_connections=max_connections,
                timeout_s=timeout_s,
                header_timeout_s=header_timeout_s,
            )
        raise OSError(
            errno.EADDRINUSE,
            f"distmon: port {port} on {addr} is already in use; pass port=0 (ephemeral), another "
            f"port (DISTMON_PORT), or port_fallback=True (the default) to take a free one",
        ) from last

    def attach(self, collector: Collector) -> None:
        self.registry.register(collector)

    def close(self) -> None:
        """Stop serving and free the port; connections in flight are cut. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        self._workers.close()
        self._bcrypt.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- lanes (worker threads) ------------------------------------------------------------------
    def _answer(self, job: tuple[_Conn, dict[str, str]]) -> None:
        conn, env = job
        try:
            response = self._respond(conn, env)
        except Exception:
            self._errors.record("the metrics endpoint")
            response = _SERVER_ERROR
        self._deliver(conn, response)

    def _check(self, job: tuple[_Conn, dict[str, str], Claim]) -> None:
        conn, env, claim = job
        assert self._auth is not None
        if self._auth.verify(claim) is not Verdict.ACCEPT:
            self._deliver(conn, _UNAUTHORIZED)
        elif not self._workers.submit((conn, env)):
            self._deliver(conn, _BUSY)

    def _respond(self, conn: _Conn, env: dict[str, str]) -> bytes:
        """Run the WSGI app on one request; the whole response, ready to send."""
        environ: dict[str, object] = {
            **env,
            "SCRIPT_NAME": "",
            "SERVER_NAME": str(self.addr),
            "SERVER_PORT": str(self.port),
            "REMOTE_ADDR": str(conn.client[0]),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": self.scheme,
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        head: list[str | list[tuple[str, str]]] = []
        body: list[bytes] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: object = None
        ) -> Callable[[bytes], None]:
            head[:] = [status, headers]
            return body.append

        result = self._app(environ, start_response)
        try:
            body.extend(result)
        finally:
            getattr(result, "close", lambda: None)()
        if str(head[0]).startswith("200"):
            with self._scraped:
                self.scrapes += 1
                self._scraped.notify_all()
        return http_response(head[0], head[1], b"".join(body))

    def url(self, host: str) -> str:
        """Where this endpoint serves metrics, for clients that reach it as ``host``."""
        return f"{self.scheme}://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def wait_for_scrapes(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` scrapes were answered (at most ``timeout`` s); whether they were."""
        with self._scraped:
            return self._scraped.wait_for(lambda: self.scrapes >= count, timeout)

    def _deliver(self, conn: _Conn, response: bytes) -> None:
        with self._lock:
            self._answered.append((conn, response))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed (the server is closing)
            pass

    # -- serving thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                try:
                    for key, _ in self._selector.select(self._next_timeout()):
                        if key.fileobj is self._listener:
                            self._accept()
                        elif key.fileobj is self._wake_r:
                            with contextlib.suppress(BlockingIOError):
                                self._wake_r.recv(4096)
                        elif key.data in self._held:  # not dropped earlier in this batch
                            self._step(key.data)
                    self._send_answers()
                    self._expire()
                except Exception:
                    self._errors.record("the metrics endpoint's serving thread")
                    self._stop.wait(0.1)
        finally:
            for conn in [*self._held, *self._busy]:
                conn.sock.close()
            self._held.clear()
            self._busy.clear()
            self._selector.close()

    def _next_timeout(self) -> float | None:
        ends = [c.expires for c in self._held] + [c.deadline for c in self._busy]
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def _accept(self) -> None:
        while True:
            try:
                sock, client = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, say: do not spin on a readable listener
                self._stop.wait(0.1)
                return
            while len(self._held) >= MAX_IDLE:
                self._drop(next(iter(self._held)))
            sock.setblocking(False)
            stage = _Stage.HEAD
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except OSError:
                    sock.close()
                    continue
                stage = _Stage.HANDSHAKE
            now = time.monotonic()
            conn = _Conn(
                sock,
                client=client,
                stage=stage,
                expires=now + self.header_timeout_s,
                deadline=now + self.timeout_s,
            )
            self._held[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _step(self, conn: _Conn) -> None:
        """Take ``conn`` as far as it goes without waiting."""
        try:
            if conn.stage is _Stage.HANDSHAKE:
                conn.sock.do_handshake()  # type: ignore[attr-defined]
                conn.stage = _Stage.HEAD
            if conn.stage is _Stage.HEAD:
                self._read_head(conn)
            elif conn.stage is _Stage.WRITE:
                self._write(conn)
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
        except BlockingIOError:
            self._want(conn, selectors.EVENT_WRITE if conn.stage is _Stage.WRITE else selectors.EVENT_READ)
        except ssl.SSLError as e:
            if e.reason == "HTTP_REQUEST":  # say why, as Go's servers do, instead of a bare reset
                try:
                    socket.socket.send(conn.sock, _HTTP_TO_HTTPS)
                except OSError:
                    pass
            self._drop(conn)
        except OSError:  # the client went away or failed the handshake
            self._drop(conn)

    def _read_head(self, conn: _Conn) -> None:
        while True:
            data = conn.sock.recv(4096)
            if not data:
                self._drop(conn)
                return
            conn.inbox += data
            end = _HEAD_END.search(conn.inbox, max(0, len(conn.inbox) - len(data) - 3))
            if end is not None and end.end() <= MAX_HEAD:
                self._route(conn, bytes(conn.inbox[: end.end()]))
                return
            if len(conn.inbox) > MAX_HEAD:
                self._reply(conn, _HEAD_TOO_LARGE)
                return

    def _route(self, conn: _Conn, head: bytes) -> None:
        """A complete head: answer it now, or hand it to the bcrypt thread or a worker."""
        conn.inbox = bytearray()
        conn.expires = conn.deadline
        env = parse_head(head)
        if env is None:
            self._reply(conn, _BAD_REQUEST)
            return
        verdict = Verdict.ACCEPT if self._auth is None else self._auth.screen(env.get("HTTP_AUTHORIZATION"))
        if isinstance(verdict, Claim):
            handed = self._bcrypt.submit((conn, env, verdict))
        elif verdict is Verdict.ACCEPT:
            handed = self._workers.submit((conn, env))
        else:
            self._reply(conn, _UNAUTHORIZED if verdict is Verdict.REJECT else _NO_USERS)
            return
        if not handed:
            self._reply(conn, _BUSY)
            return
        self._selector.unregister(conn.sock)
        del self._held[conn]
        conn.stage = _Stage.BUSY
        self._busy.add(conn)

    def _reply(self, conn: _Conn, response: bytes) -> None:
        conn.stage, conn.outbox, conn.sent = _Stage.WRITE, response, 0
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.sent < len(conn.outbox):
            conn.sent += conn.sock.send(conn.outbox[conn.sent : conn.sent + _CHUNK])
        self._drop(conn)

    def _send_answers(self) -> None:
        with self._lock:
            answered, self._answered = self._answered, deque()
        for conn, response in answered:
            if conn not in self._busy:  # timed out meanwhile
                continue
            self._busy.remove(conn)
            self._held[conn] = None
            conn.events = selectors.EVENT_WRITE
            self._selector.register(conn.sock, conn.events, conn)
            conn.stage, conn.outbox, conn.sent = _Stage.WRITE, response, 0
            self._step(conn)

    def _want(self, conn: _Conn, events: int) -> None:
        if conn.events != events:
            self._selector.modify(conn.sock, events, conn)
            conn.events = events

    def _drop(self, conn: _Conn) -> None:
        """Close ``conn`` (it leaves every table)."""
        if conn in self._held:
            del self._held[conn]
            self._selector.unregister(conn.sock)
        self._busy.discard(conn)
        _close(conn.sock)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [c for c in self._held if c.expires <= now] + [c for c in self._busy if c.deadline <= now]
        for conn in expired:
            self._drop(conn)
