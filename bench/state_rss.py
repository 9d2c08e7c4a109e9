#!/usr/bin/env python3
"""RSS against --state-bytes (issue 38). Two workloads on the built binary,
each with its own origin (standard library HTTP server on 127.0.0.1:0) and a
fresh proxy:

  urls:  40 distinct URLs of 10 MiB each (max-age=600), fetched one after
         another with plain GETs, under --state-bytes 128MiB;
  hosts: 30 subscriptions to one 10 MiB URL, each with another Host header
         (so 30 variants), 0.3 s apart, held open and never read, under
         --state-bytes 64MiB.

Prints, per workload, RSS before, at its peak and SETTLE seconds after
(default 12), the growth, its ratio to the cap, and the proxy's own
braid_proxy_state_bytes, _state_evictions_total and _state_refusals_total.

    python3 bench/state_rss.py target/release/braid-proxy [SETTLE]

Loopback only; every wait is bounded. Installs nothing.
"""

import http.server
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request

BODY = 10 * 1024 * 1024
MIB = 1024 * 1024


class Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        name = self.path.rsplit("/", 1)[-1].encode() or b"x"
        body = (name * (BODY // len(name) + 1))[:BODY]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=600")
        self.send_header("ETag", '"e%s"' % name.decode())
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a refused subscription's answer, dropped by the proxy

    def log_message(self, *args):
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def run(binary, mode, cap, settle):
    origin = Server(("127.0.0.1", 0), Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    admin = free_port()
    proxy = subprocess.Popen(
        [binary, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:%d" % admin,
         "--upstream", "http://127.0.0.1:%d" % origin.server_address[1],
         "--state-bytes", cap, "--max-body-bytes", "16MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = None
        deadline = time.time() + 10
        while addr is None and time.time() < deadline:
            m = re.search(r"listening on http://(\S+)", proxy.stdout.readline())
            addr = m.group(1) if m else None
        if addr is None:
            raise SystemExit("the proxy did not start")
        host, port = addr.rsplit(":", 1)
        time.sleep(0.5)
        base = peak = rss_mib(proxy.pid)
        held = []
        if mode == "urls":
            for i in range(40):
                with urllib.request.urlopen("http://%s/u/%d" % (addr, i), timeout=30) as r:
                    r.read()
                peak = max(peak, rss_mib(proxy.pid))
        else:
            for i in range(30):
                s = socket.create_connection((host, int(port)), timeout=10)
                s.sendall(b"GET /doc HTTP/1.1\r\nHost: h%d.example\r\nSubscribe: true\r\n\r\n" % i)
                held.append(s)
                time.sleep(0.3)
                peak = max(peak, rss_mib(proxy.pid))
        end_at = time.time() + settle
        while time.time() < end_at:
            peak = max(peak, rss_mib(proxy.pid))
            time.sleep(0.5)
        end = rss_mib(proxy.pid)
        metrics = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin, timeout=10).read().decode()
        def metric(name):
            m = re.search(r"^braid_proxy_%s (\d+)" % name, metrics, re.M)
            return int(m.group(1)) if m else -1
        cap_mib = int(cap.rstrip("MiB"))
        print("%-5s cap %4d MiB: RSS %5.0f -> peak %5.0f -> %5.0f MiB after %ds; growth %5.0f MiB (%.2fx cap); "
              "state_bytes %.0f MiB, evictions %d, refusals %d" % (
                  mode, cap_mib, base, peak, end, settle, end - base, (end - base) / cap_mib,
                  metric("state_bytes") / MIB, metric("state_evictions_total"),
                  metric("state_refusals_total")))
        for s in held:
            s.close()
    finally:
        proxy.kill()
        proxy.wait()
        origin.shutdown()


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    settle = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    run(sys.argv[1], "urls", "128MiB", settle)
    run(sys.argv[1], "hosts", "64MiB", settle)


if __name__ == "__main__":
    main()
