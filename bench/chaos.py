#!/usr/bin/env python3
"""A chaos run over a tree of tiers: a plain REST origin (in this script), a
shield braid-proxy polling it, and two edges relaying the shield's Braid
subscriptions (edge-1 over HTTP/1.1, edge-2 over h2c). Subscribers on the
edges follow every resource and rebuild its body from the 209 stream;
writers PUT whole bodies through random tiers at a steady rate. Meanwhile a
seeded schedule of faults: the shield or an edge SIGKILLed and started
again on the same port, the origin answering 503 for a spell, the origin
hanging (accepting and reading requests, answering none) for a spell, and
subscriber connections cut.

A checker counts a violation for a version the origin never had, a version
older than one the subscriber already saw, a rebuilt body that differs from
the origin's body at that version (or a patch whose Parents is not the
version the subscriber holds), a proxy that exits by itself, and a
subscriber that is not at the origin's latest version 10 s after the last
fault ended (faults and writes stop at --secs, then it waits up to 10 s).

    python3 bench/chaos.py --secs 20 [--binary target/release/braid-proxy] [--seed N]

Prints one JSON line (faults, violations, subscribers, updates, writes, and
details: the first violations with what the subscriber saw and the faults
just before, the fault counts, where the logs are) and exits 0 with no
violation, 1 with some, 2 when the harness itself failed (a binary that
does not start, a subscriber that never got its first update).

Subscribers reconnect as braid-http's client does (`Parents` = the version
they hold), after 0.2 s, then up to 1 s apart (braid-http waits 1 s, 2 s,
3 s, ...; shorter waits keep the 10 s check about the proxies), 30% of
them at a random edge (`--switch`), as behind a load balancer. The seed
fixes the schedule of faults, writes and cuts, not the interleaving of the
processes. Loopback only, Python 3 standard library only, every wait
bounded; every process it starts is killed on exit, Ctrl-C included.
"""

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from harness import (CHILDREN, HarnessError, StreamEnded, die_with_parent,
                     kill_children, now, read_request, reap)

RESOURCES = {"/a.txt": "a", "/b.txt": "b"}  # path -> version prefix
SETTLE = 10.0  # seconds after the last fault within which everyone is current
RETRY_FIRST, RETRY_MAX = 0.2, 1.0
IDLE = 60.0  # a stream silent this long is given up (and counted as a stall)
IO = 5.0  # connect, request head, write answer
START = 15.0  # a proxy's banner, every subscriber's first update
WORDS = ["braid", "proxy", "édition", "straße", "日本語", "🙂", "naïve", "Ωmega",
         "tier", "shield", "edge", "x", "versions", "𝔘nicode", "\t", "end"]


class Log:
    """The run's clock and fault timeline."""

    def __init__(self):
        self.t0 = now()
        self.faults = []  # (t, kind, detail)
        self.ends = []  # (t, kind): when a kill or spell ended

    def t(self):
        return round(now() - self.t0, 3)

    def fault(self, kind, detail=""):
        self.faults.append((self.t(), kind, detail))

    def fault_end(self, kind):
        self.ends.append((self.t(), kind))

    def faults_before(self, t, n=4):
        return [f"{ft:.2f}s {k} {d}".strip() for ft, k, d in self.faults if ft <= t][-n:]


# ---------------------------------------------------------------- the origin

class Origin:
    """Plain REST: GET gives the body with ETag "<prefix><n>", If-None-Match
    gives 304, PUT stores a new version. Every version's body is kept.
    `mode` is "ok", "503" or "hang"."""

    def __init__(self):
        self.history = {p: {} for p in RESOURCES}  # path -> version id -> (n, body str)
        self.latest = {}  # path -> (version id, n, body)
        self.made = {p: {} for p in RESOURCES}  # path -> n -> when
        self.mode = "ok"
        self.hang_over = asyncio.Event()
        self.hang_over.set()
        self.requests = collections.Counter()
        self.server = None
        self.port = None

    def put(self, path, body):
        n = self.latest[path][1] + 1 if path in self.latest else 1
        vid = f"{RESOURCES[path]}{n}"
        self.history[path][vid] = (n, body)
        self.made[path][n] = now()
        self.latest[path] = (vid, n, body)
        return vid

    def order(self, path, vid):
        entry = self.history[path].get(vid)
        return entry[0] if entry else None

    def start_spell(self, mode):
        self.mode = mode
        if mode == "hang":
            self.hang_over.clear()

    def end_spell(self):
        self.mode = "ok"
        self.hang_over.set()

    async def start(self):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0, limit=1 << 20)
        self.port = self.server.sockets[0].getsockname()[1]

    async def serve(self, reader, writer):
        try:
            while True:
                request = await read_request(reader, IO)
                if request is None:
                    return
                method, target, headers, body = request
                self.requests[f"{method} {self.mode}"] += 1
                if self.mode == "hang":
                    # Accepted and read, never answered: the connection is
                    # dropped when the spell ends.
                    await asyncio.wait_for(self.hang_over.wait(), 120)
                    return
                close = headers.get("connection", "").lower() == "close"
                writer.write(self.answer(method, target.split("?")[0], headers, body))
                await asyncio.wait_for(writer.drain(), IO)
                if close:
                    return
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                asyncio.LimitOverrunError):
            return
        except asyncio.CancelledError:
            # The run is over. Ending quietly: the stream server's callback
            # calls exception() on this task, which raises on a cancelled one.
            return
        finally:
            writer.transport.abort()

    def answer(self, method, path, headers, body):
        if self.mode == "503":
            return response(503, b"unavailable\n", [("Content-Type", "text/plain")])
        if path not in self.latest:
            return response(404, b"", [])
        if method in ("GET", "HEAD"):
            vid, _, text = self.latest[path]
            etag = f'"{vid}"'
            inm = headers.get("if-none-match", "")
            if inm.strip() == "*" or etag in [t.strip() for t in inm.split(",")]:
                return response(304, b"", [("ETag", etag)])
            data = text.encode()
            return response(200, b"" if method == "HEAD" else data,
                            [("ETag", etag), ("Content-Type", "text/plain; charset=utf-8")],
                            length=len(data))
        if method == "PUT":
            try:
                text = body.decode()
            except UnicodeDecodeError:
                return response(400, b"not UTF-8\n", [])
            vid = self.put(path, text)
            return response(204, b"", [("ETag", f'"{vid}"')])
        return response(405, b"", [("Allow", "GET, HEAD, PUT")])


def response(status, body, headers, length=None):
    reason = {200: "OK", 204: "No Content", 304: "Not Modified", 400: "Bad Request",
              404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
    out = [f"HTTP/1.1 {status} {reason}"]
    out += [f"{k}: {v}" for k, v in headers]
    if status not in (204, 304):
        out.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(out) + "\r\n\r\n").encode() + body


# ---------------------------------------------------------------- the tiers

def free_port():
    """A free loopback port below the ephemeral range, so that no outgoing
    connection takes it while its tier is down."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low - 1))
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise HarnessError("no free port below the ephemeral range")


class Tier:
    """One braid-proxy process; restarts reuse its port."""

    def __init__(self, name, binary, args, logdir, log):
        self.name, self.binary, self.args, self.logdir, self.log = name, binary, args, logdir, log
        self.port = None
        self.proc = None
        self.incarnation = 0
        self.down = False  # killed on purpose
        self.crashes = []

    async def start(self):
        for attempt in range(5):
            port = self.port or free_port()
            self.incarnation += 1
            base = os.path.join(self.logdir, f"{self.name}.{self.incarnation}")
            with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
                self.proc = subprocess.Popen(
                    [self.binary, "--listen", f"127.0.0.1:{port}", "--proxy-id", self.name] + self.args(),
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                    env={**os.environ, "NO_COLOR": "1"})
            CHILDREN.append(self.proc)
            deadline = now() + START
            while now() < deadline:
                with open(base + ".out", "rb") as f:
                    if re.search(rb"listening on http://127\.0\.0\.1:(\d+)", f.read()):
                        self.port = port
                        self.down = False
                        return
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.02)
            reap(self.proc)
            with open(base + ".err", "rb") as f:
                err = f.read().decode(errors="replace")[-300:]
            if "Address already in use" not in err or attempt == 4:
                raise HarnessError(f"{self.name} did not start ({self.binary}): {err.strip()!r}")
            await asyncio.sleep(0.5)

    def kill(self):
        self.down = True
        reap(self.proc)

    def check(self):
        """Records an exit nobody asked for; True when it happened."""
        if self.down or self.proc is None or self.proc.poll() is None:
            return False
        base = os.path.join(self.logdir, f"{self.name}.{self.incarnation}")
        with open(base + ".err", "rb") as f:
            tail = f.read().decode(errors="replace")[-300:]
        self.crashes.append((self.log.t(), self.proc.returncode, tail))
        self.down = True
        return True


# ---------------------------------------------------------------- subscribers

class ProtocolError(Exception):
    pass


class Body:
    """The 209's body, unchunked, read by lines and lengths."""

    def __init__(self, reader, chunked):
        self.r, self.chunked, self.buf = reader, chunked, bytearray()

    async def fill(self):
        if not self.chunked:
            data = await asyncio.wait_for(self.r.read(65536), IDLE)
            if not data:
                raise StreamEnded
            self.buf += data
            return
        line = await asyncio.wait_for(self.r.readuntil(b"\r\n"), IDLE)
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            raise StreamEnded
        data = await asyncio.wait_for(self.r.readexactly(size + 2), IDLE)
        if data[-2:] != b"\r\n":
            raise ProtocolError("chunk not followed by CRLF")
        self.buf += data[:-2]

    async def readline(self):
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                return line
            if len(self.buf) > 1 << 16:
                raise ProtocolError("header line over 64 KiB")
            await self.fill()

    async def readexactly(self, n):
        while len(self.buf) < n:
            await self.fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


async def read_headers(body, first):
    headers, line = {}, first
    while line.strip():
        name, colon, value = line.decode("utf-8", "replace").partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
        line = await body.readline()
    return headers


async def read_update(body):
    """One update: (status or None, headers, snapshot bytes or None,
    patches [(unit, start, end, bytes)] or None)."""
    line = await body.readline()
    while not line.strip():
        line = await body.readline()
    status = None
    if line.startswith(b"HTTP"):
        status = int(line.split()[1])
        line = await body.readline()
    headers = await read_headers(body, line)
    if "patches" in headers:
        patches = []
        for _ in range(int(headers["patches"])):
            line = await body.readline()
            while not line.strip():
                line = await body.readline()
            ph = await read_headers(body, line)
            patches.append(parse_patch(ph, await body.readexactly(int(ph["content-length"]))))
        return status, headers, None, patches
    if "content-length" not in headers:
        raise ProtocolError(f"update without Content-Length: {headers}")
    content = await body.readexactly(int(headers["content-length"]))
    if "content-range" in headers:
        return status, headers, None, [parse_patch(headers, content)]
    return status, headers, content, None


def parse_patch(headers, content):
    m = re.fullmatch(r"\s*(\w+)\s*\[(\d+):(\d+)\]\s*", headers.get("content-range", ""))
    if not m:
        raise ProtocolError(f"bad Content-Range {headers.get('content-range')!r}")
    return m.group(1), int(m.group(2)), int(m.group(3)), content


def versions(value):
    try:
        ids = json.loads("[" + value + "]") if value and value.strip() else []
    except ValueError:
        raise ProtocolError(f"malformed version list {value!r}")
    if not all(isinstance(v, str) for v in ids):
        raise ProtocolError(f"malformed version list {value!r}")
    return ids


def apply_patches(text, patches):
    """braid-text's rule: ranges absolute against the text before the
    update, sorted, not overlapping. Returns the text or raises ValueError."""
    units = {p[0] for p in patches}
    if units == {"bytes"}:
        doc = text.encode()
    elif units == {"text"}:
        doc = text
    else:
        raise ValueError(f"unsupported or mixed units {sorted(units)}")
    out, pos = [], 0
    for _, a, b, content in patches:
        if a < pos or b < a or b > len(doc):
            raise ValueError(f"range [{a}:{b}] out of order or past the end ({len(doc)})")
        out.append(doc[pos:a])
        out.append(content if units == {"bytes"} else content.decode())
        pos = b
    out.append(doc[pos:])
    if units == {"bytes"}:
        return b"".join(out).decode()
    return "".join(out)


class Subscriber:
    """Follows one resource at one edge; a resume goes to the other edge
    now and then (`switch`), as a client behind a balancer may."""

    def __init__(self, sid, edges, edge, path, origin, checker, log, rng, switch):
        self.sid, self.edges, self.edge, self.path = sid, edges, edge, path
        self.rng, self.switch = rng, switch
        self.origin, self.checker, self.log = origin, checker, log
        self.version = None  # the version whose body we hold
        self.text = None  # None: unknown (after a violation)
        self.high = 0  # highest origin counter seen
        self.updates = self.snapshots = self.patch_updates = 0
        self.connects = self.cuts = self.stalls = self.repeats = 0
        self.statuses = collections.Counter()
        self.events = collections.deque(maxlen=12)
        self.writer = None
        self.first = asyncio.Event()

    def event(self, what):
        self.events.append(f"{self.log.t():.2f}s {what}")

    def violation(self, kind, detail):
        self.checker.violation(self, kind, detail)

    async def run(self, stop):
        wait = 0.0
        while not stop.is_set():
            try:
                await self.once()
            except asyncio.TimeoutError:  # before OSError, of which it is a subclass
                if self.connected:
                    self.stalls += 1
                self.event("timed out")
            except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    StreamEnded, ProtocolError, ValueError) as e:
                if isinstance(e, ProtocolError):
                    self.violation("protocol", str(e))
                self.event(f"ended: {type(e).__name__} {e}".strip())
            finally:
                if self.writer is not None:
                    self.writer.transport.abort()
                self.writer = None
                got, self.connected = self.connected, False
            wait = RETRY_FIRST if got or wait == 0 else min(RETRY_MAX, wait * 2)
            if self.rng.random() < self.switch:
                self.edge = self.rng.choice(self.edges)
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except asyncio.TimeoutError:
                pass

    connected = False

    async def once(self):
        """One connection, read until it ends or fails."""
        self.connects += 1
        r, w = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", self.edge.port, limit=1 << 20), IO)
        self.writer = w
        parents = f"Parents: {json.dumps(self.version)}\r\n" if self.version and self.text is not None else ""
        self.event(f"connect {self.edge.name} {parents.strip() or 'no Parents'}")
        w.write(f"GET {self.path} HTTP/1.1\r\nHost: chaos\r\nSubscribe: true\r\n{parents}\r\n".encode())
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), IO)
        status = int(head.split(b" ", 2)[1])
        if status != 209:
            self.statuses[status] += 1
            self.event(f"status {status}")
            return
        self.connected = True
        self.event("209")
        chunked = b"chunked" in head.lower()
        body = Body(r, chunked)
        while True:
            status, headers, snapshot, patches = await read_update(body)
            self.apply(status, headers, snapshot, patches)

    def apply(self, status, headers, snapshot, patches):
        self.first.set()
        self.updates += 1
        self.checker.updates += 1
        vs = versions(headers.get("version", ""))
        ps = versions(headers.get("parents", ""))
        kind = "snapshot" if patches is None else f"{len(patches)} patches"
        self.event(f"update {vs} parents {ps} {kind}" + (f" status {status}" if status else ""))
        if len(vs) != 1:
            self.violation("version", f"update with Version {vs}")
            self.text = None
            return
        vid = vs[0]
        n = self.origin.order(self.path, vid)
        if n is None:
            self.violation("unknown version", f"{vid!r} (status {status}), the origin never had it")
            self.version, self.text = vid, None
            return
        if n < self.high:
            self.violation("went back", f"{vid} after {self.origin_name(self.high)}")
        elif vid == self.version:
            self.repeats += 1
        self.high = max(self.high, n)
        if status not in (None, 200):
            self.violation("status", f"{vid} came with status {status}")
        if patches is None:
            self.snapshots += 1
            try:
                text = snapshot.decode()
            except UnicodeDecodeError:
                self.violation("body", f"snapshot of {vid} is not UTF-8")
                self.version, self.text = vid, None
                return
        else:
            self.patch_updates += 1
            if self.text is None:
                self.version = vid
                return  # the base is already a violation
            if ps != [self.version]:
                self.violation("parents", f"patch to {vid} with Parents {ps}, subscriber holds {self.version}")
                self.version, self.text = vid, None
                return
            try:
                text = apply_patches(self.text, patches)
            except (ValueError, UnicodeDecodeError) as e:
                self.violation("patch", f"patch to {vid} does not apply: {e}")
                self.version, self.text = vid, None
                return
        want = self.origin.history[self.path][vid][1]
        if text != want:
            i = next((k for k, (x, y) in enumerate(zip(text, want)) if x != y), min(len(text), len(want)))
            self.violation("body", f"body at {vid} differs from the origin's ({kind}; {len(text)} "
                                   f"vs {len(want)} code points, first difference at {i})")
            self.version, self.text = vid, None
            return
        self.version, self.text = vid, text

    def lag(self):
        """Seconds since the origin made the first version this subscriber
        does not have yet; 0 when current."""
        have = self.origin.order(self.path, self.version) or 0
        if have >= self.origin.latest[self.path][1]:
            return 0.0
        return now() - self.origin.made[self.path][have + 1]

    def origin_name(self, n):
        return f"{RESOURCES[self.path]}{n}"

    def cut(self):
        if self.writer is None:
            return False
        sock = self.writer.get_extra_info("socket")
        try:
            # RST rather than FIN: the edge sees a reset connection.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except (OSError, AttributeError):
            pass
        self.writer.transport.abort()
        self.cuts += 1
        self.event("cut by the harness")
        return True


class Checker:
    def __init__(self, log, keep=10):
        self.log, self.keep = log, keep
        self.count = 0
        self.kinds = collections.Counter()
        self.first = []
        self.updates = 0

    def violation(self, sub, kind, detail):
        self.count += 1
        self.kinds[kind] += 1
        if len(self.first) < self.keep:
            t = self.log.t()
            self.first.append({
                "t": t, "subscriber": sub.sid if sub else None, "kind": kind, "detail": detail,
                "seen": list(sub.events) if sub else [],
                "faults_before": self.log.faults_before(t),
            })


# ---------------------------------------------------------------- writes

def edit(rng, text, serial):
    """A new body: a few edits of the current one, now and then a rewrite,
    and a serial line so that no two versions are the same."""
    lines = text.split("\n")
    if lines and lines[0].startswith("write "):
        lines = lines[1:]
    text = "\n".join(lines)
    if rng.random() < 0.05 or not text:
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                         for _ in range(rng.randint(5, 30)))
    for _ in range(rng.choice([1, 1, 1, 2, 3, 5])):
        i = rng.randint(0, len(text))
        op = rng.random()
        if op < 0.4 or len(text) < 200:
            text = text[:i] + rng.choice([" ", "\n", ""]) + rng.choice(WORDS) + text[i:]
        elif op < 0.75 or len(text) > 3000:
            text = text[:i] + text[i + rng.randint(1, 30):]
        else:
            text = text[:i] + rng.choice(WORDS) + text[i + rng.randint(1, 10):]
    return f"write {serial}\n{text}"


async def http_put(port, path, text):
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO)
    try:
        data = text.encode()
        w.write(f"PUT {path} HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n"
                f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), IO)
        return int(head.split(b" ", 2)[1])
    finally:
        w.transport.abort()


class Writers:
    def __init__(self, origin, tiers, rate, rng, log):
        self.origin, self.tiers, self.rate, self.rng, self.log = origin, tiers, rate, rng, log
        self.sent = 0
        self.statuses = collections.Counter()
        self.inflight = set()

    async def run(self, until):
        serial = 0
        next_at = now()
        while now() < until:
            next_at += 1.0 / self.rate
            await asyncio.sleep(max(0.0, next_at - now()))
            serial += 1
            path = self.rng.choice(sorted(RESOURCES))
            via = self.rng.choice(["origin"] + [t.name for t in self.tiers])
            text = edit(self.rng, self.origin.latest[path][2], serial)
            if len(self.inflight) >= 16:
                self.statuses["skipped (16 in flight)"] += 1
                continue
            task = asyncio.create_task(self.one(via, path, text))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)

    async def one(self, via, path, text):
        self.sent += 1
        port = self.origin.port if via == "origin" else next(t for t in self.tiers if t.name == via).port
        try:
            status = await http_put(port, path, text)
            self.statuses[f"{via} {status}"] += 1
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            self.statuses[f"{via} {type(e).__name__}"] += 1

    async def drain(self):
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=2 * IO + 1)


# ---------------------------------------------------------------- faults

async def faults(shield, edges, origin, locks, rng, until, log):
    """One lane of infrastructure faults, with gaps. Two lanes run at once,
    so faults overlap (an edge down while the origin hangs), but each
    target has one fault at a time. The last fault ends at or shortly
    after `until`."""
    while now() < until:
        await asyncio.sleep(rng.uniform(0.5, 4.0))
        if now() >= until:
            break
        kind = rng.choice(["kill shield", "kill edge", "origin 503", "origin hang"])
        spell = rng.uniform(0.1, 2.0) if kind.startswith("kill") else rng.uniform(0.5, 4.0)
        target = {"kill shield": shield, "kill edge": rng.choice(edges)}.get(kind, origin)
        async with locks[id(target)]:
            if target is origin:
                log.fault(kind, f"{spell:.2f}s")
                origin.start_spell(kind.split()[1])
                await asyncio.sleep(spell)
                origin.end_spell()
            else:
                log.fault(kind, f"{target.name} down {spell:.2f}s")
                target.kill()
                await asyncio.sleep(spell)
                await target.start()
            log.fault_end(kind)


async def cuts(subs, rng, until, log):
    while now() < until:
        await asyncio.sleep(rng.uniform(0.5, 3.0))
        if now() >= until:
            break
        for s in rng.sample(subs, rng.randint(1, min(3, len(subs)))):
            if s.cut():
                log.fault("cut", s.sid)


async def watch_lag(subs, lags, log):
    """The largest time a subscriber spent behind the origin (faults make
    some: a dead shield, a hung origin), when, and who."""
    while True:
        await asyncio.sleep(0.25)
        for s in subs:
            lag = s.lag()
            if lag > lags["max_s"]:
                lags.update(max_s=round(lag, 2), who=s.sid, at=log.t())
            lags["samples"] += 1
            lags["over_5s"] += lag > 5


async def watch_crashes(tiers, checker, log):
    while True:
        await asyncio.sleep(0.25)
        for t in tiers:
            if t.check():
                rc, tail = t.crashes[-1][1:]
                log.fault("crash", t.name)
                checker.violation(None, "crash", f"{t.name} exited by itself (status {rc}): {tail.strip()[-200:]}")
                await t.start()


# ---------------------------------------------------------------- the run

async def run(args, out):
    log = Log()
    logdir = tempfile.mkdtemp(prefix="braid-chaos-")
    out["logs"] = logdir
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    out["seed"] = seed
    fault_rngs = [random.Random(f"{seed}/faults/{lane}") for lane in range(2)]
    cut_rng, write_rng = (random.Random(f"{seed}/{k}") for k in ("cuts", "writes"))

    origin = Origin()
    for path in RESOURCES:
        origin.put(path, edit(write_rng, "", 0))
    await origin.start()
    binary = os.path.abspath(args.binary)
    if not os.access(binary, os.X_OK):
        raise HarnessError(f"no executable at {binary}")
    common = ["--heartbeat", "0", "--connect-timeout", "1s", "--shutdown-grace", "1s"]
    def kind(k):
        return [] if args.auto else ["--upstream-kind", k]
    shield = Tier("shield", binary, lambda: [
        "--upstream", f"http://127.0.0.1:{origin.port}", *kind("rest"),
        "--poll-interval", "100ms", "--response-timeout", "2s"] + common, logdir, log)
    await shield.start()
    edges = [
        Tier("edge-1", binary, lambda: [
            "--upstream", f"http://127.0.0.1:{shield.port}", *kind("braid"),
            "--response-timeout", "5s"] + common, logdir, log),
        Tier("edge-2", binary, lambda: [
            "--upstream", f"http://127.0.0.1:{shield.port}", *kind("braid"),
            "--upstream-h2c", "--response-timeout", "5s"] + common, logdir, log),
    ]
    for e in edges:
        await e.start()
    tiers = [shield] + edges
    checker = Checker(log)
    stop = asyncio.Event()
    subs = []
    for e in edges:
        for path in RESOURCES:
            for i in range(args.subs):
                sid = f"{e.name}{path}#{i}"
                subs.append(Subscriber(sid, edges, e, path, origin, checker, log,
                                       random.Random(f"{seed}/{sid}"), args.switch))
    tasks = [asyncio.create_task(s.run(stop)) for s in subs]
    lags = {"max_s": 0.0, "who": None, "at": None, "samples": 0, "over_5s": 0}
    watchers = [asyncio.create_task(watch_crashes(tiers, checker, log)),
                asyncio.create_task(watch_lag(subs, lags, log))]
    try:
        try:
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in subs)), START)
        except asyncio.TimeoutError:
            late = [s.sid for s in subs if not s.first.is_set()]
            raise HarnessError(f"no first update within {START}s for {late}")

        until = now() + args.secs
        writers = Writers(origin, tiers, args.write_rate, write_rng, log)
        locks = {id(t): asyncio.Lock() for t in tiers + [origin]}
        chaos = [asyncio.create_task(writers.run(until)),
                 asyncio.create_task(cuts(subs, cut_rng, until, log))]
        chaos += [asyncio.create_task(faults(shield, edges, origin, locks, rng, until, log))
                  for rng in fault_rngs]
        done, _ = await asyncio.wait(chaos, timeout=args.secs + 30)
        for t in chaos:
            if t not in done:
                t.cancel()
                raise HarnessError("the fault or write schedule overran its time")
            if t.exception():
                raise t.exception()
        origin.end_spell()
        for t in tiers:
            if t.down:
                await t.start()
        last_fault = now()
        await writers.drain()
        # Everyone current within SETTLE of the last fault (or of the last
        # write's answer, when one was still in flight).
        deadline = max(last_fault, now()) + SETTLE
        while now() < deadline:
            if all(s.version == origin.latest[s.path][0] and s.text is not None for s in subs):
                break
            await asyncio.sleep(0.05)
        settle = now() - last_fault
        for s in subs:
            latest = origin.latest[s.path][0]
            if s.version != latest:
                s.event(f"check: origin at {latest}")
                checker.violation(s, "not current",
                                  f"at {s.version} {SETTLE:.0f}s after the last fault; the origin is at "
                                  f"{latest} (connected: {s.connected})")
    finally:
        stop.set()
        for t in tasks + watchers:
            t.cancel()
        await asyncio.gather(*tasks, *watchers, return_exceptions=True)

    fault_kinds = collections.Counter(k for _, k, _ in log.faults)
    out.update({
        "faults": len(log.faults),
        "violations": checker.count,
        "subscribers": len(subs),
        "updates": checker.updates,
        "writes": writers.sent,
        "origin_versions": sum(len(h) for h in origin.history.values()),
        "fault_kinds": dict(fault_kinds),
        "violation_kinds": dict(checker.kinds),
        "first_violations": checker.first,
        "snapshots": sum(s.snapshots for s in subs),
        "patch_updates": sum(s.patch_updates for s in subs),
        "repeats": sum(s.repeats for s in subs),
        "connects": sum(s.connects for s in subs),
        "stalls": sum(s.stalls for s in subs),
        "lag": lags,
        "non_209": dict(sum((s.statuses for s in subs), collections.Counter())),
        "write_answers": dict(writers.statuses),
        "origin_requests": dict(origin.requests),
        "settle_s": round(settle, 2),
        "secs": args.secs,
        "upstream_kind": "auto" if args.auto else "shield rest, edges braid",
        "binary": binary,
    })
    with open(os.path.join(logdir, "faults.txt"), "w") as f:
        for ft, what in sorted([(ft, f"{k} {d}") for ft, k, d in log.faults] +
                               [(ft, f"end of {k}") for ft, k in log.ends]):
            f.write(f"{ft:.3f} {what}\n")
    return checker.count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--secs", type=float, required=True, help="seconds of faults and writes")
    ap.add_argument("--binary", default="target/release/braid-proxy")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--subs", type=int, default=3, help="subscribers per edge and resource")
    ap.add_argument("--write-rate", type=float, default=5.0, help="PUTs per second")
    ap.add_argument("--switch", type=float, default=0.3,
                    help="chance that a resume goes to a random edge (maybe the other one)")
    ap.add_argument("--auto", action="store_true",
                    help="no --upstream-kind: every tier learns its upstream's kind (the default)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the proxies' logs on success too")
    args = ap.parse_args()
    out = {}
    code = 2
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(run(args, out))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        violations = loop.run_until_complete(task)
        code = 1 if violations else 0
    except HarnessError as e:
        out["error"] = str(e)
    except asyncio.CancelledError:
        out["error"] = "interrupted"
        code = 130
    except Exception as e:  # a harness bug: report it, still clean up
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        kill_children()
        # As asyncio.run does: cancel what is left (the origin's connections,
        # a write in flight) and let it finish before the loop closes.
        try:
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=IO))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
    if code == 0 and not args.keep_logs and out.get("logs"):
        import shutil
        shutil.rmtree(out["logs"], ignore_errors=True)
        out["logs"] = None
    head = {k: out.pop(k) for k in ("faults", "violations", "subscribers", "updates", "writes") if k in out}
    line = json.dumps({**head, **out}, ensure_ascii=False)
    if out.get("logs"):
        try:
            with open(os.path.join(out["logs"], "result.json"), "w") as f:
                f.write(line + "\n")
        except OSError:
            pass  # the line is printed all the same
    print(line)
    sys.exit(code)


if __name__ == "__main__":
    main()
