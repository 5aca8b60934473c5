"""The metrics endpoint (distmon/serve/http_server.py, distmon/serve/endpoint_security.py): TLS, mutual TLS,
basic auth, bounds, timeouts, and the attacks of issue #24.

Real servers on 127.0.0.1 (ephemeral ports), real TLS with certificates made by the openssl
CLI, real bcrypt hashes, real client sockets. Every server is closed by the test that
started it. The attacks run through ``benchmarks/endpoint_attacks.py`` (the endpoint in a
child process, as in a training process; the attackers and a Prometheus-like scraper here).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import http.client
import os
import select
import socket
import ssl
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ddp_harness import free_port
from prometheus_client.core import GaugeMetricFamily
from secure_endpoint import Pki, make_pki, run_openssl, write_htpasswd

from distmon.serve.http_server import MAX_CONNECTIONS, EndpointSecurity, MetricServer
from distmon.setup.config import MonitorConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import endpoint_attacks  # noqa: E402

USER, PASSWORD = "prometheus", "s3cret pass:word"


class Demo:
    """Two gauges; ``describe`` lets ``name[]`` pick among them."""

    def collect(self):
        yield GaugeMetricFamily("demo_a", "Gauge a.", value=1.0)
        yield GaugeMetricFamily("demo_b", "Gauge b.", value=2.0)

    describe = collect


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> Path:
    return write_htpasswd(tmp_path_factory.mktemp("auth") / "users", {USER: PASSWORD, "other": "x"})


@pytest.fixture(scope="module")
def attack_dir(tmp_path_factory) -> Path:
    """Certificates and users files (bcrypt cost 12, as the README's recipe, and 8) for endpoint_attacks."""
    return endpoint_attacks.prepare(tmp_path_factory.mktemp("attacks"), costs=(12, 8))


@contextlib.contextmanager
def serving(security: EndpointSecurity | None = None, **kwargs) -> Iterator[MetricServer]:
    server = MetricServer.bind("127.0.0.1", 0, False, security, **kwargs)
    try:
        server.attach(Demo())
        yield server
    finally:
        server.close()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def get(
    server: MetricServer,
    path: str = "/metrics",
    *,
    ca: Path | None = None,
    client: Pki | None = None,
    auth: str | None = None,
    method: str = "GET",
) -> tuple[int, http.client.HTTPMessage, str]:
    """One request: (status, headers, body); over TLS when ``ca`` is given."""
    if ca is not None:
        context = ssl.create_default_context(cafile=str(ca))
        if client is not None:
            context.load_cert_chain(client.client_cert, client.client_key)
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=10)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": auth} if auth else {})
        r = conn.getresponse()
        return r.status, r.headers, r.read().decode()
    finally:
        conn.close()


def endpoint_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("distmon-http")]


def settled_threads(expected: int, timeout: float = 2.0) -> list[str]:
    """The endpoint's threads, once at most ``expected`` are left (workers end just after their close)."""
    deadline = time.monotonic() + timeout
    while len(threads := endpoint_threads()) > expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return threads


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset readable now)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


# --------------------------------------------------------------------------- TLS


def test_https_scrape_with_the_ca_and_not_over_plain_http(pki):
    with serving(EndpointSecurity(pki.server_cert, pki.server_key)) as server:
        assert server.scheme == "https"
        status, _, body = get(server, ca=pki.ca)
        assert status == 200 and "demo_a 1.0" in body
        assert "python_info" not in body, "the global registry must not be served"
        status, _, body = get(server)  # plain HTTP to the TLS port
        assert status == 400 and "HTTPS server" in body and "demo_a" not in body
        with pytest.raises(ssl.SSLCertVerificationError):
            get(server, ca=pki.client_cert)  # a CA that did not sign the server's certificate


def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    security = EndpointSecurity(pki.server_cert, pki.server_key, tls_client_ca=pki.ca)
    with serving(security) as server:
        with pytest.raises(OSError):  # the handshake fails (TLS 1.3: at the client's first read)
            get(server, ca=pki.ca)
        status, _, body = get(server, ca=pki.ca, client=pki)
        assert status == 200 and "demo_b 2.0" in body


# --------------------------------------------------------------------------- basic auth


def test_basic_auth_over_tls(pki, users):
    with serving(EndpointSecurity(pki.server_cert, pki.server_key, basic_auth_file=users)) as server:
        for auth in (None, basic(USER, "wrong"), basic("nobody", PASSWORD), "Bearer abc", "Basic !!"):
            status, headers, body = get(server, ca=pki.ca, auth=auth)
            assert status == 401, auth
            assert headers["WWW-Authenticate"] == 'Basic realm="distmon"'
            assert "demo_a" not in body
        status, _, body = get(server, ca=pki.ca, auth=basic(USER, PASSWORD))
        assert status == 200 and "demo_a 1.0" in body
        assert get(server, ca=pki.ca, auth=basic("other", PASSWORD))[0] == 401


def test_basic_auth_without_tls_works_and_warns(users, caplog):
    with caplog.at_level("WARNING", logger="distmon"):
        with serving(EndpointSecurity(basic_auth_file=users)) as server:
            assert server.scheme == "http"
            assert get(server)[0] == 401
            assert get(server, auth=basic(USER, PASSWORD))[0] == 200
    warnings = [r.getMessage() for r in caplog.records if "clear text" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


def test_a_verified_password_is_not_checked_by_bcrypt_again(tmp_path):
    slow = write_htpasswd(tmp_path / "slow", {USER: PASSWORD}, rounds=12)  # ~0.3-0.6 s per check
    with serving(EndpointSecurity(basic_auth_file=slow)) as server:
        t0 = time.perf_counter()
        assert get(server, auth=basic(USER, PASSWORD))[0] == 200
        first = time.perf_counter() - t0
        again = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert get(server, auth=basic(USER, PASSWORD))[0] == 200
            again.append(time.perf_counter() - t0)
        assert get(server, auth=basic(USER, "wrong"))[0] == 401  # the cache holds successes only
    assert first > 0.15, f"the first scrape did not pay bcrypt ({first:.3f} s)"
    assert statistics.median(again) < first / 10, (first, again)


def test_a_users_file_with_a_byte_order_mark_lets_its_user_in(tmp_path):
    users = write_htpasswd(tmp_path / "users", {USER: PASSWORD})
    users.write_bytes(b"\xef\xbb\xbf" + users.read_bytes())  # what Notepad saves as "UTF-8"
    with serving(EndpointSecurity(basic_auth_file=users)) as server:
        assert get(server, auth=basic(USER, PASSWORD))[0] == 200
        assert get(server, auth=basic("\ufeff" + USER, PASSWORD))[0] == 401


def _status_within(server: MetricServer, auth: str, status: int, seconds: float = 4.0) -> int:
    """Poll until a request with ``auth`` gets ``status`` (the file is looked at once a second)."""
    deadline = time.monotonic() + seconds
    while (got := get(server, auth=auth)[0]) != status and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


@pytest.mark.slow  # waits out the users file's reload (~4 s)
def test_a_rotated_users_file_takes_effect_without_a_restart(tmp_path):
    users = write_htpasswd(tmp_path / "users", {USER: "old password"})
    with serving(EndpointSecurity(basic_auth_file=users)) as server:
        assert get(server, auth=basic(USER, "old password"))[0] == 200  # verified, remembered
        assert get(server, auth=basic(USER, "new password"))[0] == 401  # refused, remembered
        write_htpasswd(tmp_path / "users.new", {USER: "new password"})
        os.replace(tmp_path / "users.new", users)  # rotation by rename
        assert _status_within(server, basic(USER, "new password"), 200) == 200
        assert get(server, auth=basic(USER, "old password"))[0] == 401, "a rotated-out password still works"
        write_htpasswd(users, {USER: "third password"})  # rotation in place, same size
        assert _status_within(server, basic(USER, "third password"), 200) == 200
        assert get(server, auth=basic(USER, "new password"))[0] == 401
        users.unlink()  # fail closed while the file is missing
        assert _status_within(server, basic(USER, "third password"), 503) == 503
        write_htpasswd(users, {USER: "third password"})
        assert _status_within(server, basic(USER, "third password"), 200) == 200


@pytest.mark.slow
def test_an_unknown_user_costs_what_a_wrong_password_costs(attack_dir):
    """At the file's own cost (8 here; distmon used to check unknown users at a fixed cost 10)."""
    with endpoint_attacks.endpoint(attack_dir, cost=8) as ep:
        ep.request(basic(USER, "warm-up"))
        times = endpoint_attacks.probe_timing(ep, 15)
    unknown, wrong = (statistics.median(t) for t in times.values())
    assert 0.6 < unknown / wrong < 1.6, {k: [round(x, 4) for x in v] for k, v in times.items()}


# --------------------------------------------------------------------------- bad settings


def test_options_that_do_not_go_together():
    with pytest.raises(ValueError, match=r"tls_cert \(DISTMON_TLS_CERT\) needs tls_key"):
        EndpointSecurity(tls_cert="a.pem")
    with pytest.raises(ValueError, match=r"tls_key \(DISTMON_TLS_KEY\) needs tls_cert"):
        EndpointSecurity(tls_key="a.key")
    with pytest.raises(ValueError, match=r"tls_client_ca \(DISTMON_TLS_CLIENT_CA\) needs tls_cert"):
        EndpointSecurity(tls_client_ca="ca.pem")
    with pytest.raises(TypeError, match="basic_auth_file"):
        EndpointSecurity(basic_auth_file=3)


@pytest.mark.parametrize(
    "variable", ["DISTMON_TLS_CERT", "DISTMON_TLS_KEY", "DISTMON_TLS_CLIENT_CA", "DISTMON_BASIC_AUTH_FILE"]
)
def test_an_empty_security_variable_is_an_error(monkeypatch, variable):
    """A typo that empties one must not serve plain HTTP without auth; other empty variables mean unset."""
    monkeypatch.setenv("DISTMON_PORT", "")
    assert MonitorConfig.from_options(port=None).port == 9290
    for value in ("", "  "):
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=f"{variable} is set but empty"):
            MonitorConfig.from_options(tls_cert=None, tls_key=None, tls_client_ca=None, basic_auth_file=None)


def _encrypted_key(pki: Pki, directory: Path) -> Path:
    """The server's key, encrypted with a passphrase (OpenSSL would prompt for it)."""
    run_openssl(
        "pkey",
        "-in",
        str(pki.server_key),
        "-aes256",
        "-passout",
        "pass:secret",
        "-out",
        "encrypted.key",
        cwd=directory,
    )
    return directory / "encrypted.key"


@pytest.mark.parametrize("case", ["missing cert", "key of another cert", "encrypted key", "bad client CA"])
def test_tls_files_that_cannot_be_loaded_are_named(pki, tmp_path, case):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    security, option, path = {
        "missing cert": (EndpointSecurity(missing, pki.server_key), "tls_cert", missing),
        "key of another cert": (EndpointSecurity(pki.server_cert, pki.client_key), "tls_key", pki.client_key),
        "encrypted key": (
            EndpointSecurity(pki.server_cert, _encrypted_key(pki, tmp_path)),
            "tls_key",
            tmp_path / "encrypted.key",
        ),
        "bad client CA": (
            EndpointSecurity(pki.server_cert, pki.server_key, tls_client_ca=garbage),
            "tls_client_ca",
            garbage,
        ),
    }[case]
    port = free_port()
    with pytest.raises(ValueError) as e:
        MetricServer.bind("127.0.0.1", port, False, security)
    msg = str(e.value)
    assert msg.startswith("distmon: ") and option in msg and f"'{path}'" in msg, msg
    if case == "encrypted key":
        assert "encrypted" in msg, msg
    with socket.create_server(("127.0.0.1", port)):  # nothing was bound before the files were read
        pass


@pytest.mark.parametrize(
    "content,line,needle",
    [
        (None, None, "cannot be read"),
        ("", None, "is empty"),
        ("\n\n", None, "is empty"),
        ("{ok}\nbob:plaintext-password\n", 2, "is not 'user:bcrypt-hash'"),
        ("{ok}\n\nalice-without-colon\n", 3, "is not 'user:bcrypt-hash'"),
        ("{ok}\n{ok}\n", 2, "listed twice"),
    ],
)
def test_bad_basic_auth_files_are_named_with_the_line(tmp_path, content, line, needle):
    path = tmp_path / "users"
    if content is not None:
        ok = write_htpasswd(tmp_path / "ok", {"alice": "pw"}).read_text().strip()
        path.write_text(content.replace("{ok}", ok))
    with pytest.raises(ValueError) as e:
        EndpointSecurity(basic_auth_file=path).load()
    msg = str(e.value)
    assert msg.startswith("distmon: basic_auth_file (DISTMON_BASIC_AUTH_FILE)") and f"'{path}'" in msg, msg
    assert needle in msg, msg
    if line is not None:
        assert f"line {line}" in msg, msg
    assert "plaintext-password" not in msg, "a bad line may hold a password: never echo it"


def test_basic_auth_without_bcrypt_says_how_to_install_it(users, monkeypatch):
    monkeypatch.setitem(sys.modules, "bcrypt", None)  # what `import bcrypt` sees when it is not installed
    with pytest.raises(ValueError, match="pip install bcrypt"):
        EndpointSecurity(basic_auth_file=users).load()


# --------------------------------------------------------------------------- bounds and timeouts


@pytest.mark.serial  # served within the timeout: run alone
def test_idle_and_stalled_connections_hold_no_threads_and_time_out(pki, users):
    timeout_s = 2.0
    security = EndpointSecurity(pki.server_cert, pki.server_key, basic_auth_file=users)
    auth = basic(USER, PASSWORD)
    with serving(security, timeout_s=timeout_s) as server:
        assert get(server, ca=pki.ca, auth=auth)[0] == 200  # pays bcrypt once, before the clock
        t0 = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
        stalled = []  # half a TLS ClientHello each: the serving thread holds them, no worker
        for _ in range(MAX_CONNECTIONS // 2):
            stalled.append(socket.create_connection(("127.0.0.1", server.port)))
            stalled[-1].sendall(b"\x16\x03\x01\x02\x00\x01")
        time.sleep(0.3)
        assert settled_threads(1, timeout=0.5) == ["distmon-http"]  # (they time out at 2 s)
        status, _, body = get(server, ca=pki.ca, auth=auth)  # while they are held
        assert status == 200 and "demo_a 1.0" in body
        assert time.monotonic() - t0 < timeout_s, "too slow to show the scrape succeeded while they were held"

        closed_at: dict[socket.socket, float] = {}
        while len(closed_at) < len(idle + stalled) and time.monotonic() - t0 < timeout_s + 3:
            for s in idle + stalled:
                if s not in closed_at and closed_by_server(s):
                    closed_at[s] = time.monotonic() - t0
            time.sleep(0.05)
        assert len(closed_at) == len(idle + stalled), (
            f"{len(idle + stalled) - len(closed_at)} connections still open {timeout_s + 3:.0f} s after "
            "they were made"
        )
        first_stalled = min(closed_at[s] for s in stalled)
        assert first_stalled >= timeout_s * 0.9, (
            f"a stalled handshake was dropped after {first_stalled:.2f} s"
        )
        status, _, body = get(server, ca=pki.ca, auth=auth)  # after they timed out
        assert status == 200 and "demo_a 1.0" in body
        assert settled_threads(1) == ["distmon-http"]
        for s in idle + stalled:
            s.close()


@pytest.mark.serial  # dropped within 0.8-2.5 s: run alone
def test_a_client_that_dribbles_bytes_is_dropped_at_the_deadline():
    with serving(timeout_s=1.0) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        t0 = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for byte in b"X-Slow: " + b"a" * 100:  # one byte every 0.1 s: never quiet for a whole timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
            if closed or closed_by_server(sock):
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        sock.close()
        assert elapsed < 2.5, f"a dribbling client was served for {elapsed:.1f} s with timeout_s=1"
        assert elapsed > 0.8
        assert get(server)[0] == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", ["half-open-tls:16", "slow-request:12", "slow-request:20", "wrong-passwords:24"]
)
def test_prometheus_is_answered_in_time_under_attack(attack_dir, spec):
    """Issue #24's attacks at its sizes: every scrape (verified credentials) succeeds, well within 10 s."""
    name, _, clients = spec.partition(":")
    with endpoint_attacks.endpoint(attack_dir) as ep:
        outcome = endpoint_attacks.attack(ep, name, int(clients), seconds=6)
    attacked = sum(outcome.attackers.values())
    assert attacked >= int(clients), f"the attack did not take place: {outcome}"
    assert outcome.failed == 0 and len(outcome.latencies) >= 8, outcome
    assert statistics.median(outcome.latencies) < 1.0 and max(outcome.latencies) < 5.0, outcome


def _raw_exchange(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def test_malformed_and_oversized_request_heads_are_answered_at_once():
    with serving() as server:
        assert _raw_exchange(server.port, b"hello\r\n\r\n").startswith(b"HTTP/1.0 400 ")
        big = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
        assert _raw_exchange(server.port, big).startswith(b"HTTP/1.0 431 ")
        ok = _raw_exchange(server.port, b"GET /metrics?name[]=demo_b HTTP/1.0\n\n")  # bare LF
        assert ok.startswith(b"HTTP/1.0 200 ") and b"demo_b 2.0" in ok and b"demo_a" not in ok


# --------------------------------------------------------------------------- HTTP and binding


def test_name_filter_and_methods_reach_the_client_app_unchanged():
    with serving() as server:
        status, _, body = get(server, "/metrics?name[]=demo_b")
        assert status == 200 and "demo_b 2.0" in body and "demo_a" not in body
        status, _, body = get(server, "/metrics?name[]=demo_a&name[]=demo_b")
        assert "demo_a 1.0" in body and "demo_b 2.0" in body
        assert get(server, method="POST")[0] == 405


def test_bind_errors_say_what_they_are():
    with serving() as server:
        with pytest.raises(OSError) as e:
            MetricServer.bind("127.0.0.1", server.port, False)
        assert e.value.errno == errno.EADDRINUSE and "already in use" in str(e.value)
        fallback = MetricServer.bind("127.0.0.1", server.port, True)
        try:
            assert fallback.port > server.port
        finally:
            fallback.close()
        # every port it would try next is taken too: an ephemeral one, never a failed job
        with contextlib.ExitStack() as taken:
            for p in (server.port + 1, server.port + 2):
                s = taken.enter_context(socket.socket())
                with contextlib.suppress(OSError):
                    s.bind(("127.0.0.1", p))
                    s.listen(1)
            last_resort = MetricServer.bind("127.0.0.1", server.port, True, tries=3)
            try:
                assert last_resort.port not in (server.port, server.port + 1, server.port + 2), (
                    last_resort.port
                )
                assert last_resort.port > 0
            finally:
                last_resort.close()
    with pytest.raises(socket.gaierror) as e:
        MetricServer.bind("not-an-ip", 9290, False)
    msg = str(e.value)
    assert e.value.errno != errno.EADDRINUSE and "in use" not in msg, msg
    assert "not-an-ip:9290" in msg and "DISTMON_ADDR" in msg, msg


def test_close_frees_the_port():
    with serving() as server:
        port = server.port
        assert get(server)[0] == 200
    server.close()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    again = MetricServer.bind("127.0.0.1", port, False)
    try:
        assert again.port == port
    finally:
        again.close()
    assert settled_threads(0) == []


def test_a_restarted_worker_waits_for_its_predecessor_s_port():
    """``wait_s``: a taken port is tried again until it is free (the old process on its way out),
    and only then does the fallback move on; without it the next port is taken at once."""
    with serving() as old:
        port = old.port
        threading.Timer(0.6, old.close).start()  # the predecessor lets go a moment later
        again = MetricServer.bind("127.0.0.1", port, True, wait_s=5.0)
        try:
            assert again.port == port
        finally:
            again.close()
    with serving() as taken:
        elsewhere = MetricServer.bind("127.0.0.1", taken.port, True, wait_s=0.3)
        try:
            assert elsewhere.port != taken.port  # still taken after the wait: the fallback
        finally:
            elsewhere.close()
