#!/usr/bin/env python3
"""RSS against --state-bytes (issues 38 and 44). Named workloads on the built
binary, each with its own origin (standard library HTTP server on
127.0.0.1:0) and fresh proxies:

  urls:    40 distinct URLs of 10 MiB each (max-age=600), fetched one after
           another with plain GETs, under --state-bytes 128MiB;
  hosts:   30 subscriptions to one 10 MiB URL, each with another Host header
           (so 30 variants), 0.3 s apart, held open and never read, under
           --state-bytes 64MiB;
  headers: (issue 44 a) 600 distinct URLs whose answers carry about 300 KB
           of response headers each and a 64-byte body (max-age=600), plain
           GETs, under --state-bytes 64MiB. A fresh proxy is probed first
           with one 300 KB header line, then with lines of under 8 KB
           adding up to 300 KB, then with half as much, until the proxy
           answers 200; the largest shape it passes is used (and printed);
  relay:   (issue 44 b) a first tier (default flags) in front of the origin
           and an edge with --upstream <first tier> and --state-bytes 64MiB;
           100 raw-socket subscribers (GET /bigN, Subscribe: true), each on
           another 1 MiB resource, one after another; each reads its status
           line and then never reads again. Counts 209s and 503s; RSS and
           counters are the edge's (the first tier's are printed too);
  relayburst: (issue 57) the same, the 100 subscriptions sent at once
           (every request written before any status line is read);
  burst:   (issue 57) 100 subscriptions sent at once straight to one proxy
           (--state-bytes 64MiB), each on another 1 MiB resource of the
           origin, never read past the status line;
  churn:   (issue 57) 300 subscribers, one per resource, reading, while
           every poll gets a new 200 KB body (the proxy at full CPU), 30 s,
           --state-bytes 64MiB;
  urls1m:  (issue 44 c) 200 distinct 1 MiB URLs, plain GETs, 64MiB;
  hosts1m: (issue 44 c) one 1 MiB URL, 200 GETs with 200 Host headers, 64MiB;
  vary1m:  (issue 44 c) one 1 MiB URL answered with Vary: X-Tenant, 200 GETs
           with 200 X-Tenant values, 64MiB;
  vary3k:  (issue 44 d) one URL, Vary: X-Tenant, 14 KB bodies, 3,000
           tenants, 64MiB;
  vary6k:  (issue 44 d) the same with 6,000 tenants.

Prints, per workload, RSS before, at its peak (sampled every 50 ms and
after every request) and SETTLE seconds after the load (default 12), the
growth, its ratio to the cap, the proxy's own braid_proxy_state_bytes,
_state_evictions_total and _state_refusals_total from /metrics on its admin
listener, and the statuses the clients got.

    python3 bench/state_rss.py target/release/braid-proxy [SETTLE] [--only NAME,...]

Loopback only; every wait is bounded. Installs nothing.
"""

import collections
import http.server
import itertools
import queue
import re
import select
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request

MIB = 1024 * 1024
COUNTER = itertools.count()


# --- the origin -------------------------------------------------------------

def make_origin(body_size, vary=None, changing=False):
    """An origin whose answers are `body_size` bytes (max-age=600), one ETag
    per path, Host and `vary` header value (`changing`: a new body and ETag
    at every request, no max-age). Paths /h/SHAPE/TOTAL/NAME carry
    TOTAL bytes of response headers: SHAPE `one` is one header line, `lines`
    lines of at most 7,600 bytes of value each."""

    class Origin(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Answers go out at once, not after the proxy's delayed ACK (about
        # 40 ms per answer on a kept-alive connection otherwise).
        disable_nagle_algorithm = True

        def do_GET(self):
            parts = self.path.split("?", 1)[0].strip("/").split("/")
            tag = "%s|%s|%s" % (parts[-1], self.headers.get("Host", ""),
                                self.headers.get(vary, "") if vary else "")
            if changing:
                tag += "|%d" % next(COUNTER)
            key = tag.encode()
            body = (key * (body_size // len(key) + 1))[:body_size]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            if not changing:
                self.send_header("Cache-Control", "max-age=600")
            self.send_header("ETag", '"e%d"' % (hash(tag) & 0xFFFFFFFFFFFF))
            self.send_header("Content-Type", "application/octet-stream")
            if vary:
                self.send_header("Vary", vary)
            if len(parts) == 4 and parts[0] == "h":
                shape, total = parts[1], int(parts[2])
                if shape == "one":
                    self.send_header("X-Pad", "p" * total)
                else:
                    k = 0
                    while total > 0:
                        n = min(7600, total)
                        self.send_header("X-Pad-%d" % k, "p" * n)
                        total -= n
                        k += 1
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refused subscription's answer, dropped by the proxy

        def log_message(self, *args):
            pass

    server = Server(("127.0.0.1", 0), Origin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def handle_error(self, request, client_address):
        pass  # a connection the proxy closed (a refused subscription's answer)


# --- the proxy --------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


class Proxy:
    def __init__(self, binary, upstream, cap=None):
        self.admin = free_port()
        args = [binary, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:%d" % self.admin,
                "--upstream", upstream, "--max-body-bytes", "16MiB"]
        if cap:
            args += ["--state-bytes", cap]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        lines = queue.Queue()

        def drain():
            for line in self.proc.stdout:
                lines.put(line)
        threading.Thread(target=drain, daemon=True).start()
        self.addr = None
        deadline = time.time() + 10
        while self.addr is None and time.time() < deadline:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            m = re.search(r"listening on http://(\S+)", line)
            self.addr = m.group(1) if m else None
        if self.addr is None:
            self.stop()
            raise SystemExit("the proxy did not start")
        self.host, port = self.addr.rsplit(":", 1)
        self.port = int(port)
        self.pid = self.proc.pid

    def metrics(self):
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.admin, timeout=10).read().decode()

        def metric(name):
            m = re.search(r"^braid_proxy_%s (\d+)" % name, text, re.M)
            return int(m.group(1)) if m else -1
        return {k: metric(k) for k in ("state_bytes", "state_evictions_total", "state_refusals_total",
                                       "subscriber_pending_bytes", "history_bytes")}

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Sampler:
    """The peak of a process's RSS, sampled every 50 ms and on demand."""

    def __init__(self, pid):
        self.pid, self.peak, self.stopped = pid, rss_mib(pid), threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def sample(self):
        try:
            self.peak = max(self.peak, rss_mib(self.pid))
        except (OSError, AttributeError):
            pass

    def loop(self):
        while not self.stopped.wait(0.05):
            self.sample()

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=5)


# --- clients ----------------------------------------------------------------

def raw_get(proxy, path, host=None, headers=(), timeout=30):
    """One GET on its own connection (Connection: close), read to the end;
    returns the status (0: no answer in time). No header limits of its own,
    unlike http.client (64 KiB a line, 100 lines)."""
    deadline = time.time() + timeout
    req = "GET %s HTTP/1.1\r\nHost: %s\r\n%sConnection: close\r\n\r\n" % (
        path, host or proxy.addr, "".join("%s: %s\r\n" % h for h in headers))
    data = bytearray()
    try:
        with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as s:
            s.sendall(req.encode())
            while time.time() < deadline:
                s.settimeout(max(0.01, deadline - time.time()))
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                if len(data) < 64:
                    data += chunk[:64]
    except OSError:
        pass
    m = re.match(rb"HTTP/1\.1 (\d{3})", bytes(data))
    return int(m.group(1)) if m else 0


def status_line(sock, timeout):
    """Reads up to the end of the status line (in small reads) and no more
    than that line's last read; returns the status (0: none in time)."""
    deadline, data = time.time() + timeout, b""
    try:
        while b"\r\n" not in data and len(data) < 256 and time.time() < deadline:
            sock.settimeout(max(0.01, deadline - time.time()))
            chunk = sock.recv(32)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    m = re.match(rb"HTTP/1\.1 (\d{3})", data)
    return int(m.group(1)) if m else 0


# --- workloads --------------------------------------------------------------

def gets(paths_and_headers):
    def load(proxy, sampler, statuses, held, notes):
        for path, host, headers in paths_and_headers:
            statuses[raw_get(proxy, path, host, headers)] += 1
            sampler.sample()
    return load


def load_urls(proxy, sampler, statuses, held, notes):
    for i in range(40):
        with urllib.request.urlopen("http://%s/u/%d" % (proxy.addr, i), timeout=30) as r:
            r.read()
            statuses[r.status] += 1
        sampler.sample()


def load_hosts(proxy, sampler, statuses, held, notes):
    for i in range(30):
        s = socket.create_connection((proxy.host, proxy.port), timeout=10)
        s.sendall(b"GET /doc HTTP/1.1\r\nHost: h%d.example\r\nSubscribe: true\r\n\r\n" % i)
        held.append(s)
        time.sleep(0.3)
        sampler.sample()


def probe_headers(binary):
    """The largest response header block (of ~300 KB, one line or lines
    under 8 KB, then halves) the proxy passes on with a 200."""
    origin = make_origin(64)
    proxy = Proxy(binary, "http://127.0.0.1:%d" % origin.server_address[1])
    tried = []
    try:
        shapes = [("one", 300000), ("lines", 300000)]
        total = 150000
        while total >= 8000:
            shapes.append(("lines", total))
            total //= 2
        for n, (shape, total) in enumerate(shapes):
            status = raw_get(proxy, "/h/%s/%d/probe%d" % (shape, total, n), timeout=15)
            tried.append("%s %d B: %d" % (shape, total, status))
            if status == 200:
                return (shape, total), tried
        return None, tried
    finally:
        proxy.stop()
        origin.shutdown()


def subscribe_at_once(proxy, paths, statuses, held, sampler):
    """Sends a subscription for every path, each on its own connection,
    before reading any answer; then reads each status line (and no more)."""
    pending = []
    for path in paths:
        try:
            s = socket.create_connection((proxy.host, proxy.port), timeout=10)
            s.sendall(b"GET %s HTTP/1.1\r\nHost: docs.example\r\nSubscribe: true\r\n\r\n" % path.encode())
            held.append(s)
            pending.append(s)
        except OSError:
            statuses["connect failed"] += 1
    for s in pending:
        statuses[status_line(s, 30)] += 1
        sampler.sample()


def load_churn(proxy, sampler, statuses, held, notes):
    """300 subscribers, one per resource, read in a thread while the origin
    gives every poll a new 200 KB body; 30 s of it, RSS sampled."""
    for i in range(300):
        try:
            s = socket.create_connection((proxy.host, proxy.port), timeout=10)
            s.sendall(b"GET /churn%d HTTP/1.1\r\nHost: docs.example\r\nSubscribe: true\r\n\r\n" % i)
            statuses[status_line(s, 30)] += 1
            s.setblocking(False)
            held.append(s)
        except OSError:
            statuses["connect failed"] += 1
    stop = time.time() + 30
    received = 0
    most = collections.Counter()
    next_look = time.time() + 1
    while time.time() < stop:
        if time.time() >= next_look:
            next_look += 1
            for k, v in proxy.metrics().items():
                most[k] = max(most[k], v)
        ready, _, _ = select.select(held, [], [], 0.05)
        for s in ready:
            try:
                received += len(s.recv(1 << 16))
            except OSError:
                pass
        sampler.sample()
    notes.append("received %.0f MiB in 30 s; during it, at most: state_bytes %.1f MiB, "
                 "subscriber_pending_bytes %.1f MiB, history_bytes %.1f MiB" % (
                     received / MIB, most["state_bytes"] / MIB,
                     most["subscriber_pending_bytes"] / MIB, most["history_bytes"] / MIB))


def load_burst(proxy, sampler, statuses, held, notes):
    subscribe_at_once(proxy, ["/burst%d" % i for i in range(100)], statuses, held, sampler)


def load_relay(binary, settle, at_once=False):
    """Issue 44 b: the edge behind a first tier, 100 never-reading
    subscribers on 100 distinct 1 MiB resources (issue 57: `at_once`, all
    sent before any answer is read)."""
    origin = make_origin(1 * MIB)
    tier1 = Proxy(binary, "http://127.0.0.1:%d" % origin.server_address[1])
    edge = None
    held = []
    try:
        edge = Proxy(binary, "http://%s" % tier1.addr, "64MiB")
        time.sleep(0.5)
        base, base1 = rss_mib(edge.pid), rss_mib(tier1.pid)
        sampler, sampler1 = Sampler(edge.pid), Sampler(tier1.pid)
        statuses = collections.Counter()
        stop_at = time.time() + 180
        if at_once:
            subscribe_at_once(edge, ["/big%d" % i for i in range(100)], statuses, held, sampler)
        for i in range(0 if at_once else 100):
            if time.time() > stop_at:
                statuses["not tried"] += 100 - i
                break
            try:
                s = socket.create_connection((edge.host, edge.port), timeout=10)
                s.sendall(b"GET /big%d HTTP/1.1\r\nHost: docs.example\r\nSubscribe: true\r\n\r\n" % i)
                held.append(s)
                statuses[status_line(s, 10)] += 1
            except OSError:
                statuses["connect failed"] += 1
            sampler.sample()
        end_at = time.time() + settle
        while time.time() < end_at:
            time.sleep(0.5)
        sampler.stop()
        sampler1.stop()
        end, end1 = rss_mib(edge.pid), rss_mib(tier1.pid)
        report("relayburst" if at_once else "relay", 64, base, sampler.peak, end, settle, edge.metrics(), statuses,
               "open subscriber sockets held: %d" % len(held))
        m1 = tier1.metrics()
        print("        first tier (default 256MiB): RSS %.0f -> peak %.0f -> %.0f MiB; state_bytes %.0f MiB, "
              "evictions %d, refusals %d" % (base1, sampler1.peak, end1, m1["state_bytes"] / MIB,
                                              m1["state_evictions_total"], m1["state_refusals_total"]))
    finally:
        for s in held:
            s.close()
        if edge:
            edge.stop()
        tier1.stop()
        origin.shutdown()


def report(name, cap_mib, base, peak, end, settle, m, statuses, note=""):
    print("%-7s cap %4d MiB: RSS %5.0f -> peak %5.0f -> %5.0f MiB after %ds; growth %5.0f MiB (%.2fx cap), "
          "peak growth %5.0f MiB (%.2fx); state_bytes %.1f MiB, evictions %d, refusals %d; statuses %s%s" % (
              name, cap_mib, base, peak, end, settle, end - base, (end - base) / cap_mib,
              peak - base, (peak - base) / cap_mib, m["state_bytes"] / MIB,
              m["state_evictions_total"], m["state_refusals_total"],
              " ".join("%s:%d" % kv for kv in sorted(statuses.items(), key=lambda kv: str(kv[0]))),
              ("; " + note) if note else ""))
    sys.stdout.flush()


def run(binary, name, cap, body, vary, load, settle, note="", changing=False):
    origin = make_origin(body, vary, changing)
    proxy = Proxy(binary, "http://127.0.0.1:%d" % origin.server_address[1], cap)
    held = []
    try:
        time.sleep(0.5)
        base = rss_mib(proxy.pid)
        sampler = Sampler(proxy.pid)
        statuses = collections.Counter()
        notes = []
        load(proxy, sampler, statuses, held, notes)
        note = "; ".join(n for n in [note] + notes if n)
        end_at = time.time() + settle
        while time.time() < end_at:
            time.sleep(0.5)
        sampler.stop()
        end = rss_mib(proxy.pid)
        report(name, int(cap.rstrip("MiB")), base, sampler.peak, end, settle, proxy.metrics(),
               statuses, note)
    finally:
        for s in held:
            s.close()
        proxy.stop()
        origin.shutdown()


def tenants(n):
    return gets([("/doc", "docs.example", [("X-Tenant", "t%d" % i)]) for i in range(n)])


def main():
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        i = args.index("--only")
        if i + 1 >= len(args):
            raise SystemExit(__doc__)
        only = set(args[i + 1].split(","))
        del args[i:i + 2]
    if not args:
        raise SystemExit(__doc__)
    binary = args[0]
    settle = int(args[1]) if len(args) > 1 else 12
    names = ["urls", "hosts", "headers", "relay", "relayburst", "burst", "churn", "urls1m", "hosts1m", "vary1m", "vary3k", "vary6k"]
    if only and not only <= set(names):
        raise SystemExit("unknown workload(s): %s; known: %s" % (
            ",".join(sorted(only - set(names))), ",".join(names)))
    for name in names:
        if only and name not in only:
            continue
        if name == "urls":
            run(binary, name, "128MiB", 10 * MIB, None, load_urls, settle)
        elif name == "hosts":
            run(binary, name, "64MiB", 10 * MIB, None, load_hosts, settle)
        elif name == "headers":
            shape, tried = probe_headers(binary)
            print("headers probe (a fresh proxy): %s" % "; ".join(tried))
            if shape is None:
                print("headers skipped: no header block of 8 KB or more passed")
                continue
            load = gets([("/h/%s/%d/r%d" % (shape[0], shape[1], i), "docs.example", []) for i in range(600)])
            run(binary, name, "64MiB", 64, None, load, settle,
                "response headers: %s, %d bytes" % shape)
        elif name == "relay":
            load_relay(binary, settle)
        elif name == "relayburst":
            load_relay(binary, settle, at_once=True)
        elif name == "burst":
            run(binary, name, "64MiB", MIB, None, load_burst, settle)
        elif name == "churn":
            run(binary, name, "64MiB", 200_000, None, load_churn, settle, changing=True)
        elif name == "urls1m":
            run(binary, name, "64MiB", MIB, None,
                gets([("/u/%d" % i, "docs.example", []) for i in range(200)]), settle)
        elif name == "hosts1m":
            run(binary, name, "64MiB", MIB, None,
                gets([("/doc", "h%d.example" % i, []) for i in range(200)]), settle)
        elif name == "vary1m":
            run(binary, name, "64MiB", MIB, "X-Tenant", tenants(200), settle)
        elif name == "vary3k":
            run(binary, name, "64MiB", 14000, "X-Tenant", tenants(3000), settle)
        elif name == "vary6k":
            run(binary, name, "64MiB", 14000, "X-Tenant", tenants(6000), settle)


if __name__ == "__main__":
    main()
