#!/usr/bin/env python3
"""High availability of the shield tier behind haproxy: a plain REST origin
(in this script), two shield braid-proxies following it, haproxy in front of
the shields (`balance uri path-only`, `hash-type consistent`, health checks
with `GET /readyz` on the shields' admin listeners, `option http-no-delay`,
`option redispatch`), an edge braid-proxy whose `--upstream` is haproxy
(over h2c with `--h2c`), and N subscribers at the edge.

The run, once per `--hold` value (the edge's `--hold-upstream-breaks`):
every subscriber gets the first version; the origin changes and every
subscriber gets the second; `--writes` PUTs go through the edge, each
waited for at every subscriber (the time is reported); the shield that serves the document (the one
with subscriptions on its /metrics) is killed with SIGKILL for good, and the
origin changes at once. Measured from the kill: when haproxy marked that
shield DOWN (its stats page), when each subscriber had the third version,
how many times each subscriber connected again (a 209) and what its other
attempts got; the edge's own upstream resumes (`upstream_reconnects_total`).

Subscribers are raw HTTP/1.1 sockets (`Subscribe: true`); they rebuild the
body from snapshots and patches, and resume as braid-http's client does:
`Parents` = the version they hold, 1 s after a stream ends, then 2 s, then
every 3 s while the attempts fail.

A violation, counted per subscriber and reported with what it saw: a
version older than one it saw before (went back), a version the origin
never had, a rebuilt body unlike the origin's at that version, a subscriber
not at the last version `--settle` seconds after the kill; with
`--hold-upstream-breaks` over 0, a subscriber that had to connect again.
Also checked: before the kill exactly one shield holds the document's
subscription (the URL's hash) and got every PUT (so HTTP/1.1 writes and
h2c subscriptions hash alike), haproxy marks it DOWN, the survivor holds
the subscription after it, and no process but the victim exited.
`--without OPTION` leaves `http-no-delay` or `redispatch` out of
haproxy's configuration, to measure what each is for.

    python3 bench/ha.py                                   # release build, 20 subscribers, --hold 0 and 5s
    python3 bench/ha.py --binary target/debug/braid-proxy [--h2c]   # CI's smoke runs
    python3 bench/ha.py --runs 3 --hold 0,5s,1s --json

Prints one line per run and a summary; exits 0 with no violation, 1 with
some, 2 when the harness failed (no haproxy, a process that did not start).
Needs haproxy (Debian: apt-get install haproxy); Python 3 standard library
only. Loopback only, every wait bounded, every process it starts is killed
on exit (Ctrl-C and errors included; SIGKILL of this script too, through
PR_SET_PDEATHSIG).
"""

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from harness import (CHILDREN, HarnessError, StreamEnded, die_with_parent,
                     kill_children, now, read_request, reap)

PATH = "/doc.txt"
IO = 5.0  # connect, request head, an answer
START = 20.0  # a process's banner, haproxy's servers UP, every subscriber's first update
STEP = 15.0  # every subscriber at the version before the kill
IDLE = 60.0  # a subscription silent this long is given up
RETRIES = (1.0, 2.0, 3.0)  # braid-http's waits between attempts


# ---------------------------------------------------------------- the origin

class Origin:
    """Plain REST: GET and HEAD give the body with ETag "v<n>", If-None-Match
    with it gives 304, PUT makes a new version. Every version's body is kept."""

    def __init__(self):
        self.bodies = []  # index n-1: the body of "v<n>"
        self.requests = collections.Counter()
        self.server = None
        self.port = None
        self.change()

    def change(self):
        """A new version made at the origin itself; its id."""
        n = len(self.bodies) + 1
        lines = [f"line {i}: the document the shields share, as the origin had it" for i in range(40)]
        lines[n % 40] = f"line {n % 40}: changed in version {n}"
        self.bodies.append(f"revision {n}\n" + "\n".join(lines) + "\n")
        return f"v{n}"

    @property
    def latest(self):
        return f"v{len(self.bodies)}"

    def order(self, vid):
        """1 for "v1", ...; None for a version the origin never had."""
        m = re.fullmatch(r"v(\d+)", vid or "")
        n = int(m.group(1)) if m else 0
        return n if 1 <= n <= len(self.bodies) else None

    def body(self, vid):
        return self.bodies[self.order(vid) - 1]

    async def start(self):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def serve(self, reader, writer):
        try:
            while True:
                request = await read_request(reader, IO)
                if request is None:
                    return
                method, target, headers, body = request
                self.requests[method] += 1
                writer.write(self.answer(method, target.split("?")[0], headers, body))
                await asyncio.wait_for(writer.drain(), IO)
                if headers.get("connection", "").lower() == "close":
                    return
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                asyncio.LimitOverrunError):
            return
        except asyncio.CancelledError:
            return
        finally:
            writer.transport.abort()

    def answer(self, method, path, headers, body):
        if path != PATH:
            return http_response(404, "Not Found", b"", [])
        if method == "PUT":
            try:
                text = body.decode()
            except UnicodeDecodeError:
                return http_response(400, "Bad Request", b"not UTF-8\n", [])
            self.bodies.append(text)
            return http_response(204, "No Content", None, [("ETag", f'"{self.latest}"')])
        if method not in ("GET", "HEAD"):
            return http_response(405, "Method Not Allowed", b"", [("Allow", "GET, HEAD, PUT")])
        etag = f'"{self.latest}"'
        if etag in [t.strip() for t in headers.get("if-none-match", "").split(",")]:
            return http_response(304, "Not Modified", None, [("ETag", etag)])
        data = self.body(self.latest).encode()
        return http_response(200, "OK", b"" if method == "HEAD" else data,
                             [("ETag", etag), ("Content-Type", "text/plain; charset=utf-8")],
                             length=len(data))


def http_response(status, reason, body, headers, length=None):
    out = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    if body is not None:
        out.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(out) + "\r\n\r\n").encode() + (body or b"")


# ---------------------------------------------------------------- processes

def spawn(name, args, logdir):
    out = open(os.path.join(logdir, f"{name}.out"), "wb")
    err = open(os.path.join(logdir, f"{name}.err"), "wb")
    try:
        proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent, env={**os.environ, "NO_COLOR": "1"})
    except OSError as e:
        raise HarnessError(f"{name} did not start ({args[0]}): {e}")
    finally:
        out.close()
        err.close()
    CHILDREN.append(proc)
    return proc


def tail(logdir, name, n=400):
    try:
        with open(os.path.join(logdir, f"{name}.err"), "rb") as f:
            return f.read().decode(errors="replace")[-n:].strip()
    except OSError:
        return ""


class Proxy:
    """One braid-proxy with an admin listener, both on port 0."""

    def __init__(self, name, binary, args, logdir):
        self.name, self.logdir = name, logdir
        self.proc = spawn(name, [binary, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                                 "--proxy-id", name] + args, logdir)
        self.port = self.admin = None

    async def ready(self):
        deadline = now() + START
        path = os.path.join(self.logdir, f"{self.name}.out")
        while now() < deadline:
            with open(path, "rb") as f:
                text = f.read()
            m = re.search(rb"braid-proxy listening on http://127\.0\.0\.1:(\d+)", text)
            a = re.search(rb"admin listening on http://127\.0\.0\.1:(\d+)", text)
            if m and a:
                self.port, self.admin = int(m.group(1)), int(a.group(1))
                return self
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.02)
        raise HarnessError(f"{self.name} did not start: {tail(self.logdir, self.name)!r}")

    async def metric(self, name):
        """A value of /metrics on the admin listener (None when unreachable)."""
        try:
            status, body = await http_get(self.admin, "/metrics")
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            return None
        m = re.search(rb"(?m)^braid_proxy_" + re.escape(name.encode()) + rb"(?:\{\})? ([0-9.e+-]+)$", body)
        if status != 200 or not m:
            raise HarnessError(f"{self.name}: no braid_proxy_{name} in /metrics (status {status})")
        return float(m.group(1))


async def http_get(port, target):
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO)
    try:
        w.write(f"GET {target} HTTP/1.1\r\nHost: ha\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(r.read(), IO)
    finally:
        w.transport.abort()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = bytearray(), body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2:]
        body = bytes(out)
    return status, body


async def http_put(port, path, text):
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO)
    try:
        data = text.encode()
        w.write(f"PUT {path} HTTP/1.1\r\nHost: ha.test\r\nConnection: close\r\n"
                f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), IO)
        return int(head.split(b" ", 2)[1])
    finally:
        w.transport.abort()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HAPROXY_CFG = """\
global
    maxconn 4096
    log stdout format raw local0 info

defaults
    mode http
    log global
    option httplog
    # A subscription is logged when its 209 starts, not when it ends.
    option logasap
    option dontlognull
    timeout connect 1s
    # Longer than the heartbeat the shields send on idle subscriptions
    # (--heartbeat, 25 s by default).
    timeout client 60s
    timeout server 60s
    # Each update of a subscription goes on at once: without it, haproxy
    # sends a response's body with MSG_MORE, and the kernel holds an
    # update up to 200 ms for more to come.
    option http-no-delay
    # A connection the dead shield refuses is tried again on another
    # shield at once, not left for the health checks to find.
    retries 2
    option redispatch 1

frontend stats
    bind 127.0.0.1:{stats}
    stats enable
    stats uri /stats
    http-request set-log-level silent

frontend shields
    bind 127.0.0.1:{port}
    default_backend shields

backend shields
    # One shield per URL: its subscriptions and stored answers are not
    # duplicated; when a shield goes, only its URLs move.
    balance uri path-only
    hash-type consistent
    # Readiness, on each shield's admin listener.
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 500ms fall 2 rise 2
{servers}
"""


def haproxy_exe():
    exe = shutil.which("haproxy")
    if exe is None:
        raise HarnessError("haproxy is required but not installed (Debian: apt-get install haproxy)")
    return exe


class Haproxy:
    def __init__(self, shields, logdir, without=()):
        self.logdir = logdir
        self.port, self.stats = free_port(), free_port()
        servers = "\n".join(f"    server {s.name} 127.0.0.1:{s.port} check port {s.admin}" for s in shields)
        self.cfg = os.path.join(logdir, "haproxy.cfg")
        with open(self.cfg, "w") as f:
            cfg = HAPROXY_CFG.format(port=self.port, stats=self.stats, servers=servers)
            for option in without:
                cfg = re.sub(rf"(?m)^(\s*)(option {re.escape(option)}\b)", r"\1# left out: \2", cfg)
            f.write(cfg)
        exe = haproxy_exe()
        check = subprocess.run([exe, "-c", "-f", self.cfg], capture_output=True, timeout=IO)
        if check.returncode != 0:
            raise HarnessError(f"haproxy refused {self.cfg}: {check.stderr.decode(errors='replace')[-400:]}")
        self.proc = spawn("haproxy", [exe, "-db", "-f", self.cfg], logdir)

    async def servers(self):
        """{server name: status} from the stats page's CSV ({} when unreachable)."""
        try:
            status, body = await http_get(self.stats, "/stats;csv")
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            return {}
        lines = body.decode(errors="replace").splitlines()
        if status != 200 or not lines or not lines[0].startswith("# "):
            return {}
        cols = lines[0][2:].split(",")
        out = {}
        for line in lines[1:]:
            row = dict(zip(cols, line.split(",")))
            if row.get("pxname") == "shields" and row.get("svname") not in ("FRONTEND", "BACKEND"):
                out[row["svname"]] = row.get("status", "")
        return out

    async def ready(self, names):
        deadline = now() + START
        while now() < deadline:
            if self.proc.poll() is not None:
                raise HarnessError(f"haproxy exited: {tail(self.logdir, 'haproxy')!r}")
            states = await self.servers()
            if states and all(states.get(n, "").startswith("UP") and "going" not in states[n] for n in names):
                return
            await asyncio.sleep(0.05)
        raise HarnessError(f"haproxy's shields not UP within {START}s: {await self.servers()}")


# ---------------------------------------------------------------- subscribers

class Body:
    """A 209's chunked body, read by lines and lengths."""

    def __init__(self, reader):
        self.r, self.buf = reader, bytearray()

    async def fill(self):
        line = await asyncio.wait_for(self.r.readuntil(b"\r\n"), IDLE)
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            raise StreamEnded
        data = await asyncio.wait_for(self.r.readexactly(size + 2), IDLE)
        self.buf += data[:-2]

    async def readline(self):
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                return line
            await self.fill()

    async def readexactly(self, n):
        while len(self.buf) < n:
            await self.fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def headers(self):
        line = await self.readline()
        while not line.strip():
            line = await self.readline()
        status = None
        if line.startswith(b"HTTP/"):
            status = int(line.split()[1])
            line = await self.readline()
        out = {}
        while line.strip():
            name, colon, value = line.decode("utf-8", "replace").partition(":")
            if colon:
                out[name.strip().lower()] = value.strip()
            line = await self.readline()
        return status, out


def version_list(value):
    try:
        ids = json.loads("[" + value + "]") if value and value.strip() else []
    except ValueError:
        return None
    return ids if all(isinstance(v, str) for v in ids) else None


def apply_patches(text, patches):
    """Ranges against the text before the update, in order, not overlapping."""
    units = {u for u, _, _, _ in patches}
    if units not in ({"text"}, {"bytes"}):
        raise ValueError(f"units {sorted(units)}")
    doc = text if units == {"text"} else text.encode()
    out, pos = [], 0
    for unit, a, b, content in patches:
        if a < pos or b < a or b > len(doc):
            raise ValueError(f"range [{a}:{b}] out of order or past the end ({len(doc)})")
        out += [doc[pos:a], content.decode() if unit == "text" else content]
        pos = b
    out.append(doc[pos:])
    return "".join(out) if units == {"text"} else b"".join(out).decode()


def parse_range(value):
    m = re.fullmatch(r"\s*(\w+)\s*\[(\d+):(\d+)\]\s*", value or "")
    if not m:
        raise ValueError(f"Content-Range {value!r}")
    return m.group(1), int(m.group(2)), int(m.group(3))


class Subscriber:
    def __init__(self, sid, port, origin, t0):
        self.sid, self.port, self.origin, self.t0 = sid, port, origin, t0
        self.version = None
        self.text = None
        self.high = 0  # the highest origin version seen
        self.seen = []  # (t, version) of every update, in order
        self.connects = 0  # requests answered 209
        self.answers = collections.Counter()  # every other outcome of an attempt
        self.violations = []
        self.events = collections.deque(maxlen=16)
        self.changed = asyncio.Event()

    def t(self):
        return round(now() - self.t0, 3)

    def event(self, what):
        self.events.append(f"{self.t():.3f}s {what}")

    def violation(self, kind, detail):
        self.violations.append({"subscriber": self.sid, "kind": kind, "detail": detail,
                                "t": self.t(), "seen": list(self.events)})

    def has(self, vid):
        return self.version == vid and self.text is not None

    async def run(self, stop):
        wait = RETRIES[0]
        while not stop.is_set():
            got = False
            writer = None
            try:
                r, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), IO)
                got = await self.follow(r, writer)
            except asyncio.TimeoutError:
                self.answers["timeout"] += 1
                self.event("timed out")
            except StreamEnded:
                got = True
                self.event("stream ended")
            except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
                self.answers[type(e).__name__] += 1
                self.event(f"ended: {type(e).__name__} {e}".strip())
            finally:
                if writer is not None:
                    writer.transport.abort()
            # braid-http: 1 s after a stream that was answered, then 2 s, then 3 s.
            wait = RETRIES[0] if got else RETRIES[min(RETRIES.index(wait) + 1, len(RETRIES) - 1)]
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except asyncio.TimeoutError:
                pass

    async def follow(self, r, w):
        """One request: True when it was answered 209 (its stream then ended
        by raising StreamEnded or an error)."""
        parents = f"Parents: {json.dumps(self.version)}\r\n" if self.version and self.text is not None else ""
        w.write(f"GET {PATH} HTTP/1.1\r\nHost: ha.test\r\nSubscribe: true\r\n{parents}\r\n".encode())
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), IO)
        status = int(head.split(b" ", 2)[1])
        self.event(f"{parents.strip() or 'no Parents'}: {status}")
        if status != 209:
            self.answers[status] += 1
            return False
        self.connects += 1
        if b"transfer-encoding: chunked" not in head.lower():
            raise ValueError("a 209 that is not chunked")
        body = Body(r)
        try:
            while True:
                await self.update(body)
        except StreamEnded:
            self.event("stream ended")
            return True
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            self.event(f"stream broke: {type(e).__name__}")
            return True

    async def update(self, body):
        status, headers = await body.headers()
        if "patches" in headers:
            patches = []
            for _ in range(int(headers["patches"])):
                _, ph = await body.headers()
                patches.append((*parse_range(ph.get("content-range")),
                                await body.readexactly(int(ph["content-length"]))))
            snapshot = None
        else:
            content = await body.readexactly(int(headers.get("content-length", "0")))
            if "content-range" in headers:
                patches, snapshot = [(*parse_range(headers["content-range"]), content)], None
            else:
                patches, snapshot = None, content
        self.apply(status, headers, snapshot, patches)

    def apply(self, status, headers, snapshot, patches):
        vs = version_list(headers.get("version", ""))
        ps = version_list(headers.get("parents", ""))
        kind = "snapshot" if patches is None else f"{len(patches)} patches"
        self.event(f"update {vs} parents {ps} {kind}" + (f" status {status}" if status else ""))
        if not vs or len(vs) != 1:
            self.violation("version", f"an update with Version {headers.get('version')!r}")
            self.text = None
            return
        vid = vs[0]
        self.seen.append((self.t(), vid))
        n = self.origin.order(vid)
        if n is None:
            self.violation("unknown version", f"{vid!r}: the origin never had it")
            self.version, self.text = vid, None
            return
        if n < self.high:
            self.violation("went back", f"{vid} after v{self.high}")
        self.high = max(self.high, n)
        if status not in (None, 200):
            self.violation("status", f"{vid} came with status {status}")
        try:
            if patches is None:
                text = snapshot.decode()
            elif self.text is None or ps != [self.version]:
                raise ValueError(f"patches with Parents {ps} onto {self.version if self.text is not None else 'nothing'}")
            else:
                text = apply_patches(self.text, patches)
        except (ValueError, UnicodeDecodeError) as e:
            self.violation("patch", f"{vid}: {e}")
            self.version, self.text = vid, None
            return
        if text != self.origin.body(vid):
            self.violation("body", f"the body rebuilt at {vid} is not the origin's ({kind})")
            self.version, self.text = vid, None
            return
        self.version, self.text = vid, text
        self.changed.set()


async def all_at(subs, vid, limit):
    """Waits until every subscriber has `vid`; the time each got it, or
    None for those that did not within `limit` seconds."""
    deadline = now() + limit
    while now() < deadline and not all(s.has(vid) for s in subs):
        await asyncio.sleep(0.01)
    return [next((t for t, v in s.seen if v == vid), None) if s.has(vid) else None for s in subs]


# ---------------------------------------------------------------- one run

async def one_run(args, hold, run_no):
    logdir = tempfile.mkdtemp(prefix="braid-ha-")
    result = {"hold": hold, "run": run_no, "logs": logdir, "violations": []}
    stop = asyncio.Event()
    tasks = []
    origin = Origin()
    try:
        await origin.start()
        upstream = f"http://127.0.0.1:{origin.port}"
        shields = [Proxy(f"shield-{i}", args.binary, ["--upstream", upstream], logdir) for i in (1, 2)]
        for s in shields:
            await s.ready()
        ha = Haproxy(shields, logdir, args.without)
        await ha.ready([s.name for s in shields])
        edge = await Proxy("edge", args.binary, ["--upstream", f"http://127.0.0.1:{ha.port}",
                                                 "--hold-upstream-breaks", hold]
                           + (["--upstream-h2c"] if args.h2c else []), logdir).ready()
        t0 = now()
        subs = [Subscriber(f"sub-{i}", edge.port, origin, t0) for i in range(args.subs)]
        tasks = [asyncio.create_task(s.run(stop)) for s in subs]

        # Every subscriber at v1, then at v2 (the shield polls the origin).
        if None in await all_at(subs, "v1", START):
            raise HarnessError(f"not every subscriber got v1 within {START}s: "
                               f"{[s.events for s in subs if not s.has('v1')][:2]}")
        origin.change()
        if None in await all_at(subs, "v2", STEP):
            raise HarnessError(f"not every subscriber got v2 within {STEP}s: "
                               f"{[list(s.events) for s in subs if not s.has('v2')][:2]}")

        # Writes through the edge (haproxy, then write-through at the shield):
        # the time from each PUT until every subscriber has its version.
        to_all = []
        for i in range(args.writes):
            text = f"write {i}\n" + origin.body(origin.latest)
            sent = now()
            status = await http_put(edge.port, PATH, text)
            if status not in (200, 204):
                raise HarnessError(f"a PUT through the edge got {status}")
            wrote = origin.latest
            times = await all_at(subs, wrote, STEP)
            if None in times:
                raise HarnessError(f"not every subscriber got {wrote} within {STEP}s of its PUT: "
                                   f"{[list(s.events) for s in subs if not s.has(wrote)][:2]}")
            to_all.append(max(times) - (sent - t0))
            await asyncio.sleep(0.05)
        to_all.sort()
        result["write_to_all_ms"] = {"p50": round(1000 * to_all[len(to_all) // 2], 1),
                                     "max": round(1000 * to_all[-1], 1)} if to_all else None

        # The shield that serves the document: the one with subscriptions.
        held = {s.name: await s.metric("subscriptions") for s in shields}
        serving = [s for s in shields if held[s.name]]
        result["shield_subscriptions_before"] = held
        if len(serving) != 1:
            raise HarnessError(f"not exactly one shield serves {PATH} (balance uri): {held}")
        victim = serving[0]
        survivor = next(s for s in shields if s is not victim)
        # Writes must reach the shield that holds the subscription (there they
        # are written through to its subscribers; elsewhere it learns of them
        # by polling): the URL hashes alike over HTTP/1.1 and h2.
        with open(os.path.join(logdir, f"{victim.name}.err"), "rb") as f:
            puts = len(re.findall(rb"access: PUT " + re.escape(PATH.encode()) + rb" ", f.read()))
        if puts != args.writes:
            result["violations"].append({"subscriber": None, "kind": "write elsewhere",
                                         "detail": f"{victim.name}, which serves the subscription, got {puts} "
                                                   f"of the {args.writes} PUTs"})
        connects = {s.sid: s.connects for s in subs}
        answers = {s.sid: sum(s.answers.values()) for s in subs}
        edge_resumes = await edge.metric("upstream_reconnects_total")

        victim.proc.send_signal(signal.SIGKILL)
        killed = now()
        result["killed_at"] = time.strftime("%H:%M:%S", time.gmtime()) + f"{time.time() % 1:.6f}"[1:] + "Z"
        victim.proc.wait(timeout=IO)
        vid = origin.change()

        async def watch_down():
            while now() - killed < args.settle:
                state = (await ha.servers()).get(victim.name, "")
                if state.startswith("DOWN"):
                    return now() - killed
                await asyncio.sleep(0.02)
            return None
        down_task = asyncio.create_task(watch_down())
        times = await all_at(subs, vid, args.settle)
        held_then = {s.sid: s.version for s in subs}
        # A little longer: nothing after it may go back.
        await asyncio.sleep(args.linger)
        down = await down_task

        got = sorted(t - (killed - t0) for t in times if t is not None)
        late = [s for s, t in zip(subs, times) if t is None]
        reconnects = [s.connects - connects[s.sid] for s in subs]
        failed = collections.Counter()
        for s in subs:
            failed.update({str(k): v for k, v in s.answers.items()})
        result.update({
            "victim": victim.name,
            "subscribers": len(subs),
            "current": len(got),
            "first_s": round(got[0], 3) if got else None,
            "p50_s": round(got[len(got) // 2], 3) if got else None,
            "all_s": round(got[-1], 3) if got and not late else None,
            "reconnects": dict(sorted(collections.Counter(reconnects).items())),
            "failed_attempts": sum(sum(s.answers.values()) - answers[s.sid] for s in subs),
            "failed_answers": dict(failed),
            "haproxy_down_s": round(down, 3) if down is not None else None,
            "edge_upstream_resumes": int((await edge.metric("upstream_reconnects_total")) - edge_resumes),
            "survivor_subscriptions": await survivor.metric("subscriptions"),
            "origin_requests": dict(origin.requests),
            "killed_s": round(killed - t0, 3),
            "events_of_sub_0": list(subs[0].events),
        })
        for s in subs:
            result["violations"] += s.violations
        for s in late:
            result["violations"].append({"subscriber": s.sid, "kind": "not current",
                                         "detail": f"at {held_then[s.sid]}, not {vid}, {args.settle}s after the kill",
                                         "seen": list(s.events)})
        if hold_secs(hold) > 0:
            for s, n in zip(subs, reconnects):
                tries = n + sum(s.answers.values()) - answers[s.sid]
                if tries:
                    result["violations"].append({"subscriber": s.sid, "kind": "reconnected",
                                                 "detail": f"asked {tries} more times ({n} answered 209) although "
                                                           f"the edge holds breaks for {hold}", "seen": list(s.events)})
        if down is None:
            result["violations"].append({"subscriber": None, "kind": "health check",
                                         "detail": f"haproxy did not mark {victim.name} DOWN within {args.settle}s"})
        if not result["survivor_subscriptions"]:
            result["violations"].append({"subscriber": None, "kind": "survivor",
                                         "detail": f"{survivor.name} holds no subscription after the kill"})
        for p in [edge, survivor, ha]:
            if p.proc.poll() is not None:
                result["violations"].append({"subscriber": None, "kind": "exit",
                                             "detail": f"{getattr(p, 'name', 'haproxy')} exited by itself"})
    except HarnessError as e:
        raise HarnessError(f"{e} (hold {hold}, run {run_no}; logs: {logdir})")
    except asyncio.CancelledError:
        shutil.rmtree(logdir, ignore_errors=True)
        raise
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        kill_children()
        origin.server and origin.server.close()
    return result


def hold_secs(value):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", value.strip())
    if not m:
        raise HarnessError(f"--hold: not a duration: {value!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[m.group(2)]


def line(r, h2c=False):
    dist = ", ".join(f"{k} for {n}" for k, n in r["reconnects"].items())
    w = r.get("write_to_all_ms")
    return (f"hold {r['hold']:>4}{' h2c' if h2c else ''} run {r['run']}: "
            + (f"before the kill a PUT reached all in p50 {w['p50']} ms, max {w['max']} ms; " if w else "")
            + f"{r['current']}/{r['subscribers']} current, "
            f"all {r['all_s']} s after the kill (first {r['first_s']}, p50 {r['p50_s']}); "
            f"reconnects per subscriber: {dist}; failed attempts {r['failed_attempts']} "
            f"{r['failed_answers'] or ''}; haproxy marked {r['victim']} DOWN at {r['haproxy_down_s']} s; "
            f"edge upstream resumes {r['edge_upstream_resumes']}; violations {len(r['violations'])}")


async def main_async(args):
    results = []
    for run_no in range(1, args.runs + 1):
        for hold in args.hold.split(","):
            hold_secs(hold)
            r = await one_run(args, hold.strip(), run_no)
            results.append(r)
            print(line(r, args.h2c), flush=True)
            if not r["violations"] and not args.keep:
                shutil.rmtree(r["logs"], ignore_errors=True)
                r["logs"] = None
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="target/release/braid-proxy")
    ap.add_argument("--subs", type=int, default=20, help="subscribers at the edge")
    ap.add_argument("--hold", default="0,5s", help="the edge's --hold-upstream-breaks values, one run each")
    ap.add_argument("--runs", type=int, default=1, help="runs of each --hold value, alternated")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after the kill within which all are current")
    ap.add_argument("--linger", type=float, default=1.0, help="seconds watched after all are current")
    ap.add_argument("--writes", type=int, default=10,
                    help="PUTs through the edge before the kill, each waited for at every subscriber")
    ap.add_argument("--without", action="append", default=[], choices=["http-no-delay", "redispatch"],
                    help="leave this option out of haproxy's configuration (to see what it is for); repeatable")
    ap.add_argument("--h2c", action="store_true",
                    help="the edge reaches haproxy over h2c (--upstream-h2c; haproxy detects the preface)")
    ap.add_argument("--json", action="store_true", help="one JSON line per run as well")
    ap.add_argument("--keep", action="store_true", help="keep the logs and haproxy.cfg of passing runs")
    args = ap.parse_args()
    args.binary = os.path.abspath(args.binary)
    if not os.access(args.binary, os.X_OK):
        print(f"ha: no executable at {args.binary}", file=sys.stderr)
        sys.exit(2)
    code, results = 2, []
    try:
        haproxy_exe()
    except HarnessError as e:
        print(f"ha: {e}", file=sys.stderr)
        sys.exit(2)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(main_async(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        results = loop.run_until_complete(task)
        code = 1 if any(r["violations"] for r in results) else 0
    except HarnessError as e:
        print(f"ha: harness failed: {e}", file=sys.stderr)
    except asyncio.CancelledError:
        print("ha: interrupted", file=sys.stderr)
        code = 130
    finally:
        kill_children()
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=IO))
        loop.close()
    for r in results:
        for v in r["violations"][:5]:
            print(f"violation (hold {r['hold']}, run {r['run']}): {json.dumps(v, ensure_ascii=False)}")
        if r["violations"]:
            print(f"logs of hold {r['hold']} run {r['run']}: {r['logs']}")
        if args.json:
            print(json.dumps(r, ensure_ascii=False))
    sys.exit(code)


if __name__ == "__main__":
    main()
