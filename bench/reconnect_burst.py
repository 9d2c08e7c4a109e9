#!/usr/bin/env python3
"""The reconnect burst of a relaying edge: N subscribers on an edge that
relays a Braid upstream (a second braid-proxy, the shield, in front of the
embedded demo origin). The shield is killed and started again on the same
port; the edge ends its subscribers' streams with the upstream's, and each
subscriber reconnects at once and then every RETRY seconds, with `Parents`
set to the version it holds, as braid-http's client does. Reports how long
until every subscriber has a 209 again, how many bytes they got on resuming
(nothing changed, so a resume that needs no snapshot costs only the 209
head), and how many requests the shield saw.

    ulimit -n 20000
    python3 bench/reconnect_burst.py target/release/braid-proxy 10000

Loopback only; every wait is bounded.
"""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

RETRY = 1.0
PATH = "/notes.txt"


def start(args):
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = p.stdout.readline().decode()
    m = re.search(r"http://([\d.]+):(\d+)", line)
    if not m:
        raise SystemExit(f"no listen line from {args}: {line!r}")
    return p, int(m.group(2))


async def metric(port, name):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    data = await r.read()
    w.close()
    m = re.search(rb"\nbraid_proxy_" + name.encode() + rb" (\d+)", data)
    return int(m.group(1)) if m else -1


class Subscriber:
    def __init__(self, port):
        self.port = port
        self.version = None
        self.connected = asyncio.Event()
        self.bytes = 0
        self.attempts = 0

    async def run(self, stop):
        while not stop.is_set():
            self.attempts += 1
            try:
                await self.once()
            except (OSError, asyncio.IncompleteReadError, ConnectionError):
                pass
            self.connected.clear()
            if stop.is_set():
                return
            await asyncio.sleep(RETRY if self.attempts > 1 else 0)

    async def once(self):
        r, w = await asyncio.open_connection("127.0.0.1", self.port)
        parents = f"Parents: {self.version}\r\n" if self.version else ""
        w.write(f"GET {PATH} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\nSubscribe: true\r\n{parents}\r\n".encode())
        head = await r.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 209"):
            w.close()
            return
        self.attempts = 0
        self.connected.set()
        buf = b""
        while True:
            chunk = await r.read(65536)
            if not chunk:
                break
            self.bytes += len(chunk)
            buf = (buf + chunk)[-4096:]
            for m in re.finditer(rb"\n[Vv]ersion: (\"[^\"]*\")", buf):
                self.version = m.group(1).decode()
        w.close()


async def main():
    binary, n = sys.argv[1], int(sys.argv[2])
    shield, shield_port = start([binary, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
    admin_line = shield.stdout.readline().decode()
    shield_admin = int(re.search(r":(\d+)", admin_line.split("http://")[1]).group(1))
    edge, edge_port = start([binary, "--listen", "127.0.0.1:0", "--upstream",
                             f"http://127.0.0.1:{shield_port}", "--upstream-kind", "braid",
                             "--heartbeat", "0", "--max-subscriptions", str(n + 100)])
    stop = asyncio.Event()
    subs = [Subscriber(edge_port) for _ in range(n)]
    tasks = []
    for i, s in enumerate(subs):
        tasks.append(asyncio.create_task(s.run(stop)))
        if i % 500 == 499:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(*(s.connected.wait() for s in subs)), 120)
    for s in subs:
        s.bytes = 0
    print(f"{n} subscribers on the edge; the shield saw {await metric(shield_admin, 'requests_total')} requests")
    # Kill the shield; start it again on the same port.
    shield.send_signal(signal.SIGKILL)
    shield.wait()
    killed = time.monotonic()
    await asyncio.sleep(0.2)
    shield, _ = start([binary, "--listen", f"127.0.0.1:{shield_port}", "--admin-listen", "127.0.0.1:0"])
    admin_line = shield.stdout.readline().decode()
    shield_admin = int(re.search(r":(\d+)", admin_line.split("http://")[1]).group(1))
    restarted = time.monotonic()
    await asyncio.sleep(0.5)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(s.connected.is_set() for s in subs):
            break
        await asyncio.sleep(0.05)
    done = time.monotonic()
    back = sum(s.connected.is_set() for s in subs)
    print(f"after the kill: {back}/{n} subscribed again {done - killed:.2f} s after the kill "
          f"({done - restarted:.2f} s after the restart)")
    print(f"body bytes the subscribers got on resuming: {sum(s.bytes for s in subs)}; "
          f"requests at the restarted shield: {await metric(shield_admin, 'requests_total')}")
    stop.set()
    for t in tasks:
        t.cancel()
    edge.terminate()
    shield.terminate()


if __name__ == "__main__":
    asyncio.run(main())
