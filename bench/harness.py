"""What the bench harnesses that start processes share (chaos.py, ha.py):
their error type, a monotonic clock, child processes that die with the
harness, even when it is killed by SIGKILL, and their origins' reading of
an HTTP/1.1 request."""

import asyncio
import signal
import subprocess
import time

try:
    import ctypes
    LIBC = ctypes.CDLL(None)
except (ImportError, OSError):
    LIBC = None


class HarnessError(Exception):
    pass


class StreamEnded(Exception):
    pass


def now():
    return time.monotonic()


def die_with_parent():
    """In the child: SIGKILL when the harness dies, even by SIGKILL."""
    if LIBC is not None:
        try:
            LIBC.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except AttributeError:
            pass


# Every child started, for kill_children.
CHILDREN = []


def reap(proc):
    """Kills `proc` if it runs and waits for it (at most 5 s)."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def kill_children():
    while CHILDREN:
        reap(CHILDREN.pop())


async def read_body(reader, headers):
    """A request's body: chunked, by Content-Length, or none."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return bytes(out)
            out += (await reader.readexactly(size + 2))[:-2]
    n = int(headers.get("content-length", "0") or 0)
    return await reader.readexactly(n) if n else b""


async def read_request(reader, io_timeout, idle=120):
    """The next HTTP/1.1 request on a connection: (method, target, headers
    with lower-case names, body), or None when the client closed it or sent
    nothing for `idle` seconds. The body must come within `io_timeout`."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
    except (asyncio.IncompleteReadError, asyncio.TimeoutError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target = lines[0].split(" ")[:2]
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(read_body(reader, headers), io_timeout)
    return method, target, headers, body
