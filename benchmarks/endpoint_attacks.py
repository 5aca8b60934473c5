#!/usr/bin/env python3
"""Does the metrics endpoint answer Prometheus while slow or hostile clients attack it? On 127.0.0.1.

    python benchmarks/endpoint_attacks.py               # every attack of issue #24 at its sizes, 30 s each
    python benchmarks/endpoint_attacks.py --seconds 10 --attacks half-open-tls:16
    python benchmarks/endpoint_attacks.py --timing 20   # also: unknown user vs wrong password, cost 5, 12

Each attack gets a fresh endpoint (``distmon.serve.http_server.MetricServer`` with TLS and basic
auth; the users file at bcrypt cost 12, what the README's recipe makes) in a child process
of its own, as it runs in a training process; this process runs the attackers and a
Prometheus-like scraper: every 0.5 s a new TLS connection and a GET with credentials the
endpoint has verified before (one scrape before the attack), 10 s timeout. A scrape
succeeds if it returns 200 with the metrics within 10 s. The attacks (sizes of issue #24):

* ``half-open-tls:N``: N clients each send the first 6 bytes of a TLS ClientHello, then
  nothing; when the server closes one, it reconnects;
* ``slow-request:N``: N clients each complete the TLS handshake, then send a request head
  one byte every 0.25 s (it never ends); reconnect when cut;
* ``wrong-passwords:N``: N clients each send requests with the right user and a new random
  password, one after another, as fast as they are answered.

``--timing K`` then measures what a user-name prober sees: K requests with an unknown user
and K with a known user's wrong password (fresh random passwords, interleaved), at bcrypt
cost 5 (``htpasswd -B``'s default) and 12; medians and ranges, and whether the ranges overlap.

Every loop is bounded in time (``--seconds``) and count; only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import os
import secrets
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for path in (os.path.join(REPO, "launch"), os.path.join(REPO, "tests"), REPO):
    if path not in sys.path:
        sys.path.insert(0, path)

USER, PASSWORD = "prometheus", "the-password"
SCRAPE_TIMEOUT_S = 10.0  # Prometheus' default scrape_timeout
SCRAPE_EVERY_S = 0.5
DEFAULT_ATTACKS = ("none:0", "half-open-tls:16", "slow-request:8", "slow-request:12", "slow-request:20")
DEFAULT_ATTACKS += ("wrong-passwords:24",)
_MAX_ROUNDS = 100_000  # per attacker: a bound on its loop besides the time
_PARTIAL_CLIENT_HELLO = b"\x16\x03\x01\x02\x00\x01"  # record header and the handshake type: no more


def basic(user: str, password: str) -> str:
    """An ``Authorization`` value for HTTP basic auth.

    Example:
        >>> basic("a", "b")
        'Basic YTpi'
    """
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@dataclass
class Endpoint:
    """A served endpoint: its port and how a client trusts it."""

    port: int
    context: ssl.SSLContext

    def request(self, auth: str, timeout: float = SCRAPE_TIMEOUT_S) -> tuple[int, bytes]:
        """One GET /metrics on a new connection: (status, body)."""
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=timeout)
        try:
            conn.request("GET", "/metrics", headers={"Authorization": auth, "Accept": "text/plain"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


def _serve(directory: str, cost: int) -> None:
    """Child process: serve a secured endpoint until stdin closes; print its port first."""
    from prometheus_client.core import GaugeMetricFamily

    from distmon.serve.http_server import EndpointSecurity, MetricServer

    class Layers:
        """A payload the size of a 128-layer model's gauges."""

        def collect(self):
            family = GaugeMetricFamily("demo_layer", "A demo gauge.", labels=["layer"])
            for i in range(128):
                family.add_metric([f"blocks.{i}.mlp"], float(i))
            yield family

    pki = Path(directory)
    security = EndpointSecurity(pki / "server.pem", pki / "server.key", basic_auth_file=pki / f"users-{cost}")
    server = MetricServer.bind("127.0.0.1", 0, False, security)
    server.attach(Layers())
    print(server.port, flush=True)
    sys.stdin.read()
    server.close()


@contextlib.contextmanager
def endpoint(directory: Path, cost: int = 12) -> Iterator[Endpoint]:
    """A secured endpoint in a child process (``directory`` from :func:`prepare`), closed on exit."""
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", str(directory), str(cost)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        if not line.strip().isdigit():
            raise RuntimeError(f"the endpoint did not start (exit status {child.wait(30)})")
        yield Endpoint(int(line), ssl.create_default_context(cafile=str(directory / "ca.pem")))
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def prepare(directory: Path, costs: tuple[int, ...] = (12,)) -> Path:
    """Certificates (openssl CLI) and a users file per bcrypt cost into ``directory``."""
    from secure_endpoint import make_pki, write_htpasswd

    make_pki(directory)
    for cost in costs:
        write_htpasswd(directory / f"users-{cost}", {USER: PASSWORD}, rounds=cost)
    return directory


# --------------------------------------------------------------------------- attackers


def _half_open_tls(ep: Endpoint, stop: threading.Event, seen: Counter) -> None:
    for _ in range(_MAX_ROUNDS):
        if stop.is_set():
            return
        try:
            with socket.create_connection(("127.0.0.1", ep.port), timeout=2) as sock:
                sock.sendall(_PARTIAL_CLIENT_HELLO)
                seen["connections"] += 1
                sock.settimeout(0.25)
                while not stop.is_set():
                    try:
                        if not sock.recv(1024):
                            break  # the server closed it
                    except TimeoutError:
                        continue
        except OSError:
            stop.wait(0.05)


def _slow_request(ep: Endpoint, stop: threading.Event, seen: Counter) -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
    for _ in range(_MAX_ROUNDS):
        if stop.is_set():
            return
        try:
            raw = socket.create_connection(("127.0.0.1", ep.port), timeout=5)
            with ep.context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                seen["connections"] += 1
                for byte in head:
                    if stop.wait(0.25):
                        return
                    sock.sendall(bytes([byte]))
        except OSError:  # cut by the server: reconnect
            seen["cut"] += 1
            stop.wait(0.05)


def _wrong_passwords(ep: Endpoint, stop: threading.Event, seen: Counter) -> None:
    for _ in range(_MAX_ROUNDS):
        if stop.is_set():
            return
        try:
            status, _ = ep.request(basic(USER, secrets.token_hex(8)))
            seen[status] += 1
        except OSError:
            seen["error"] += 1
            stop.wait(0.05)


ATTACKERS: dict[str, Callable[[Endpoint, threading.Event, Counter], None]] = {
    "none": lambda ep, stop, seen: None,
    "half-open-tls": _half_open_tls,
    "slow-request": _slow_request,
    "wrong-passwords": _wrong_passwords,
}


@dataclass
class Outcome:
    """The scrapes made during one attack."""

    attack: str
    clients: int
    latencies: list[float] = field(default_factory=list)  # every scrape, failed ones included
    failed: int = 0
    attackers: Counter = field(default_factory=Counter)  # what the attackers saw

    @property
    def succeeded(self) -> int:
        return len(self.latencies) - self.failed

    def row(self) -> str:
        lat = self.latencies
        seen = ", ".join(f"{k}: {v}" for k, v in sorted(self.attackers.items(), key=str))
        return (
            f"| {self.attack} | {self.clients} | {self.succeeded}/{len(lat)} | "
            f"{statistics.median(lat):.3f} | {max(lat):.3f} | {seen} |"
        )


def scrape(ep: Endpoint) -> tuple[bool, float]:
    """One Prometheus-like scrape with verified credentials: (succeeded in time, seconds)."""
    t0 = time.perf_counter()
    try:
        status, body = ep.request(basic(USER, PASSWORD))
        ok = status == 200 and b"demo_layer" in body
    except OSError:
        ok = False
    elapsed = time.perf_counter() - t0
    return ok and elapsed <= SCRAPE_TIMEOUT_S, elapsed


def attack(ep: Endpoint, name: str, clients: int, seconds: float) -> Outcome:
    """Run ``clients`` attackers of kind ``name`` for ``seconds`` while scraping every 0.5 s."""
    if not scrape(ep)[0]:  # Prometheus has scraped before: its credentials are verified
        raise RuntimeError("the endpoint refused a scrape before the attack")
    outcome = Outcome(name, clients)
    stop = threading.Event()
    attackers = [
        threading.Thread(target=ATTACKERS[name], args=(ep, stop, outcome.attackers), daemon=True)
        for _ in range(clients)
    ]
    for t in attackers:
        t.start()
    time.sleep(min(1.0, seconds / 4))  # let the attack take hold
    end = time.monotonic() + seconds
    for _ in range(int(seconds / SCRAPE_EVERY_S) + 1):
        started = time.monotonic()
        if started >= end:
            break
        ok, elapsed = scrape(ep)
        outcome.latencies.append(elapsed)
        outcome.failed += not ok
        time.sleep(max(0.0, started + SCRAPE_EVERY_S - time.monotonic()))
    stop.set()
    for t in attackers:
        t.join(timeout=15)
    return outcome


def probe_timing(ep: Endpoint, samples: int) -> dict[str, list[float]]:
    """Seconds to a 401 for an unknown user and for a wrong password (fresh passwords, interleaved)."""
    times: dict[str, list[float]] = {"unknown user": [], "wrong password": []}
    for i in range(samples):
        kinds = list(times) if i % 2 else list(reversed(times))
        for kind in kinds:
            user = USER if kind == "wrong password" else f"nobody-{secrets.token_hex(4)}"
            t0 = time.perf_counter()
            status, _ = ep.request(basic(user, secrets.token_hex(8)))
            times[kind].append(time.perf_counter() - t0)
            if status != 401:
                raise RuntimeError(f"{kind}: HTTP {status}, expected 401")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="per attack (default 30)")
    parser.add_argument("--attacks", nargs="+", default=list(DEFAULT_ATTACKS), help="kind:clients ...")
    parser.add_argument("--timing", type=int, default=0, help="requests per kind for the user-name probe")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]))
        return
    with tempfile.TemporaryDirectory(prefix="distmon-attacks-") as tmp:
        directory = prepare(Path(tmp), (5, 12) if args.timing else (12,))
        print(f"endpoint: TLS + basic auth (bcrypt cost 12), {args.seconds:.0f} s per attack, a scrape every")
        print(f"{SCRAPE_EVERY_S} s with verified credentials, {SCRAPE_TIMEOUT_S:.0f} s timeout\n")
        print("| attack | clients | scrapes ok | median s | max s | attackers saw |")
        print("|---|---|---|---|---|---|")
        for spec in args.attacks:
            name, _, clients = spec.partition(":")
            with endpoint(directory) as ep:
                print(attack(ep, name, int(clients or 0), args.seconds).row(), flush=True)
        if args.timing:
            print("\n| bcrypt cost | unknown user: median s [min, max] ", end="")
            print("| wrong password: median s [min, max] | ranges overlap |")
            print("|---|---|---|---|")
            for cost in (5, 12):
                with endpoint(directory, cost) as ep:
                    ep.request(basic(USER, PASSWORD))  # the first request pays for the connection set-up
                    times = probe_timing(ep, args.timing)
                unknown, wrong = times.values()
                cells = [f"{statistics.median(t):.4f} [{min(t):.4f}, {max(t):.4f}]" for t in (unknown, wrong)]
                overlap = max(min(unknown), min(wrong)) <= min(max(unknown), max(wrong))
                print(f"| {cost} | {cells[0]} | {cells[1]} | {'yes' if overlap else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
