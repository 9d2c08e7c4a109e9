#!/usr/bin/env python3
"""GET cache hits per core (issue 39, item 4): braid-proxy against nginx
proxy_cache and Varnish, each a shared cache in front of the same origin.

    cargo build --release --bin braid-proxy
    python3 bench/hits.py                      # 5 rounds of 10 s per system
    python3 bench/hits.py --rounds 3 --secs 5  # shorter
    python3 bench/hits.py --systems braid,nginx --braid-arg=--workers=1
    python3 bench/hits.py --compare /tmp/braid-proxy-main   # and an earlier build

Installs nothing. It needs wrk and taskset, and for the peers nginx and
varnishd (Debian: `apt-get update && apt-get install -y nginx varnish wrk`);
a missing peer is reported and left out, a missing wrk stops the run.

One origin (Python, on loopback, not pinned, idle while the caches hit)
serves a 5,400-byte body with `Cache-Control: max-age=60` and an ETag.
Each cache runs on loopback pinned to core 0 (`taskset -c 0`):

  braid   target/release/braid-proxy --workers 1 (the single-threaded
          runtime), logs as shipped (info, the access line per request,
          on stderr, which goes to a file)
  before  the same with --compare BINARY, another build (the rounds then
          give braid-proxy/before too)
  nginx   worker_processes 1, proxy_cache in a keys zone, keep-alive to the
          origin, the default access log (combined format, to a file)
  varnish -s malloc, one thread pool, the built-in VCL with -b; it keeps
          its log in shared memory, as shipped

Every system is started once, warmed (two GETs; the second must be a hit),
and then wrk, pinned to core 1, runs `-t1 -c50 -dSECSs --latency` against
each in turn, the order rotating each round. The table gives requests/s
and p99 per system and round, the medians, and the braid-proxy/nginx
ratio (median of the per-round ratios). Per run it also prints the
origin's request count (a hit run costs it at most a revalidation a
minute), the CPU seconds the cache's processes used (close to --secs: the
cache had its core to itself and was the bottleneck), and the CPU seconds
of everything else on the machine meanwhile, neither the cache, wrk nor
the origin: other work (a build, a test run) competing with the run.
Configs and logs go to a temporary directory (--keep leaves it).
"""
import argparse
import http.server
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ORIGIN_PORT, BRAID_PORT, NGINX_PORT, VARNISH_PORT, BEFORE_PORT = 18301, 18302, 18303, 18304, 18305
PATH = '/doc'
BODY_BYTES = 5400
SYSTEMS = ('braid', 'nginx', 'varnish')

NGINX_CONF = """daemon off;
{user}
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log {dir}/nginx-access.log;
  client_body_temp_path {dir}/nginx-body;
  proxy_temp_path {dir}/nginx-proxy;
  fastcgi_temp_path {dir}/nginx-fastcgi;
  uwsgi_temp_path {dir}/nginx-uwsgi;
  scgi_temp_path {dir}/nginx-scgi;
  proxy_cache_path {dir}/nginx-cache keys_zone=hits:10m;
  upstream origin {{
    server 127.0.0.1:{origin};
    keepalive 16;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_cache hits;
      add_header X-Cache-Status $upstream_cache_status;
    }}
  }}
}}
"""


def fail(msg):
    print(f'hits.py: {msg}', file=sys.stderr)
    sys.exit(2)


def body():
    line = b'GET cache hit benchmark body, the same 5,400 bytes every time.\n'
    out = (line * (BODY_BYTES // len(line) + 1))[:BODY_BYTES - 1] + b'\n'
    assert len(out) == BODY_BYTES
    return out


class Origin(http.server.BaseHTTPRequestHandler):
    """The origin: one document, fresh for 60 s, with an ETag."""
    protocol_version = 'HTTP/1.1'
    payload = body()
    etag = '"hits-1"'
    count = 0
    lock = threading.Lock()

    def do_GET(self):
        with Origin.lock:
            Origin.count += 1
        if self.headers.get('If-None-Match') == self.etag:
            self.send_response(304)
            self.send_header('ETag', self.etag)
            self.send_header('Cache-Control', 'max-age=60')
            self.end_headers()
            return
        self.send_response(200)
        self.send_header('Content-Type', 'text/plain; charset=utf-8')
        self.send_header('Content-Length', str(len(self.payload)))
        self.send_header('Cache-Control', 'max-age=60')
        self.send_header('ETag', self.etag)
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


class OriginServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A cache closing its idle connections to the origin: not news.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def start_origin():
    try:
        server = OriginServer(('127.0.0.1', ORIGIN_PORT), Origin)
    except OSError as e:
        fail(f'cannot listen on 127.0.0.1:{ORIGIN_PORT} for the origin: {e}')
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_port(port, timeout=15.0):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(('127.0.0.1', port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def start_braid(binary, workdir, extra, port=BRAID_PORT, name='braid'):
    log = open(os.path.join(workdir, f'{name}.log'), 'wb')
    args = ['taskset', '-c', '0', binary, '--listen', f'127.0.0.1:{port}',
            '--upstream', f'http://127.0.0.1:{ORIGIN_PORT}', '--proxy-id', 'bench']
    if not any(a.startswith('--workers') for a in extra):
        args += ['--workers', '1']
    p = subprocess.Popen(args + list(extra), stdout=log, stderr=log, start_new_session=True)
    return p, port


def start_nginx(workdir):
    user = 'user root;' if os.geteuid() == 0 else ''
    conf = os.path.join(workdir, 'nginx.conf')
    with open(conf, 'w') as f:
        f.write(NGINX_CONF.format(user=user, dir=workdir, origin=ORIGIN_PORT, port=NGINX_PORT))
    log = open(os.path.join(workdir, 'nginx.out'), 'wb')
    p = subprocess.Popen(['taskset', '-c', '0', 'nginx', '-c', conf, '-p', workdir],
                         stdout=log, stderr=log, start_new_session=True)
    return p, NGINX_PORT


def start_varnish(workdir):
    log = open(os.path.join(workdir, 'varnish.out'), 'wb')
    args = ['taskset', '-c', '0', 'varnishd', '-F', '-j', 'none',
            '-n', os.path.join(workdir, 'varnish'),
            '-a', f'127.0.0.1:{VARNISH_PORT}', '-b', f'127.0.0.1:{ORIGIN_PORT}',
            '-s', 'malloc,64m', '-p', 'thread_pools=1']
    p = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    return p, VARNISH_PORT


def stop(p):
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def fetch(port):
    req = urllib.request.Request(f'http://127.0.0.1:{port}{PATH}')
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def is_hit(system, headers):
    h = {k.lower(): v for k, v in headers.items()}
    if system in ('braid', 'before'):
        return '; hit' in h.get('cache-status', '')
    if system == 'nginx':
        return h.get('x-cache-status') == 'HIT'
    return len(h.get('x-varnish', '').split()) == 2


def warm(system, port):
    last = None
    for _ in range(3):
        status, headers, data = fetch(port)
        if status != 200 or data != Origin.payload:
            fail(f'{system}: unexpected answer {status}, {len(data)} bytes')
        last = headers
    if not is_hit(system, last):
        fail(f'{system}: the third GET was not a hit: {last}')
    return last


def wrk(port, secs, conns):
    cmd = ['taskset', '-c', '1', 'wrk', '-t1', f'-c{conns}', f'-d{secs}s', '--latency',
           f'http://127.0.0.1:{port}{PATH}']
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = r.stdout
    rps = re.search(r'Requests/sec:\s+([\d.]+)', out)
    p99 = re.search(r'^\s*99%\s+([\d.]+)(us|ms|s)\s*$', out, re.M)
    if r.returncode != 0 or not rps or not p99:
        fail(f'wrk failed:\n{out}')
    scale = {'us': 0.001, 'ms': 1.0, 's': 1000.0}[p99.group(2)]
    bad = re.search(r'Non-2xx or 3xx responses:\s+(\d+)', out)
    errors = re.search(r'Socket errors:.*', out)
    return {
        'rps': float(rps.group(1)),
        'p99_ms': float(p99.group(1)) * scale,
        'non2xx': int(bad.group(1)) if bad else 0,
        'errors': errors.group(0) if errors else '',
    }


HZ = os.sysconf('SC_CLK_TCK')


def busy_jiffies():
    """CPU time (all cores, jiffies) spent on anything but idle and iowait."""
    with open('/proc/stat') as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def tree_jiffies(root):
    """user + system jiffies of a process and its descendants, all threads."""
    parents, times = {}, {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open(f'/proc/{pid}/stat') as f:
                rest = f.read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        parents[int(pid)] = int(rest[1])
        times[int(pid)] = int(rest[11]) + int(rest[12])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0)
        todo += [c for c, p in parents.items() if p == pid]
    return total


def cpu_self_and_children():
    """CPU seconds of this script (the origin's threads) and its waited children (wrk)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--secs', type=int, default=10)
    ap.add_argument('--conns', type=int, default=50)
    ap.add_argument('--systems', default=','.join(SYSTEMS))
    ap.add_argument('--binary', default=None,
                    help='braid-proxy binary (default: $CARGO_TARGET_DIR or target, release)')
    ap.add_argument('--braid-arg', action='append', default=[],
                    help='an extra braid-proxy argument (repeatable)')
    ap.add_argument('--compare', metavar='BINARY',
                    help='another braid-proxy binary (an earlier build), measured as "before"')
    ap.add_argument('--keep', action='store_true', help='keep the temporary directory')
    args = ap.parse_args()
    systems = [s for s in args.systems.split(',') if s]
    if args.compare:
        if not os.access(args.compare, os.X_OK):
            fail(f'{args.compare} is not an executable')
        systems.insert(1, 'before')
    for s in systems:
        if s not in SYSTEMS + ('before',):
            fail(f'unknown system {s}; known: {", ".join(SYSTEMS)}')

    for tool in ('taskset', 'wrk'):
        if not shutil.which(tool):
            fail(f'{tool} not found (apt-get install -y util-linux wrk)')
    if os.cpu_count() < 2:
        fail('needs two cores (the caches on core 0, wrk on core 1)')
    missing = {'nginx': 'nginx', 'varnish': 'varnishd'}
    for s, tool in missing.items():
        if s in systems and not shutil.which(tool):
            print(f'hits.py: {tool} not found, {s} left out '
                  f'(apt-get update && apt-get install -y nginx varnish)', file=sys.stderr)
            systems.remove(s)
    binary = args.binary or os.path.join(
        os.environ.get('CARGO_TARGET_DIR', os.path.join(ROOT, 'target')), 'release', 'braid-proxy')
    if 'braid' in systems and not os.access(binary, os.X_OK):
        fail(f'{binary} not found: cargo build --release --bin braid-proxy')
    if not systems:
        fail('no system to measure')

    workdir = tempfile.mkdtemp(prefix='hits-')
    if os.geteuid() == 0:
        os.chmod(workdir, 0o755)
    origin = start_origin()
    procs = {}
    try:
        for s in systems:
            port = {'braid': BRAID_PORT, 'nginx': NGINX_PORT, 'varnish': VARNISH_PORT,
                    'before': BEFORE_PORT}[s]
            if wait_port(port, timeout=0.1):
                fail(f'127.0.0.1:{port}, where {s} is to listen, is taken')
            if s == 'before':
                procs[s] = start_braid(args.compare, workdir, args.braid_arg, BEFORE_PORT, 'before')
            elif s == 'braid':
                procs[s] = start_braid(binary, workdir, args.braid_arg)
            elif s == 'nginx':
                procs[s] = start_nginx(workdir)
            else:
                procs[s] = start_varnish(workdir)
            if not wait_port(procs[s][1]):
                fail(f'{s} did not start; see {workdir}')
            warm(s, procs[s][1])
        print(f'# {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, '
              f'{os.cpu_count()} cores, {BODY_BYTES}-byte body, max-age=60, '
              f'wrk -t1 -c{args.conns} -d{args.secs}s on core 1, caches on core 0')
        results = {s: [] for s in systems}
        print('| round | system | requests/s | p99 (ms) | origin requests | cache CPU s | other CPU s |')
        print('|---|---|---|---|---|---|---|')
        for rnd in range(args.rounds):
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for s in order:
                port = procs[s][1]
                # Still a hit (it may have gone stale and been revalidated).
                if not is_hit(s, fetch(port)[1]):
                    fetch(port)
                before = Origin.count
                marks = (busy_jiffies(), tree_jiffies(procs[s][0].pid), cpu_self_and_children())
                r = wrk(port, args.secs, args.conns)
                r['origin'] = Origin.count - before
                server = (tree_jiffies(procs[s][0].pid) - marks[1]) / HZ
                ours = cpu_self_and_children() - marks[2]
                r['server_cpu'] = server
                # What else ran meanwhile (builds, tests): busy time that was
                # neither the cache, wrk, nor this script's origin.
                r['other_cpu'] = max(0.0, (busy_jiffies() - marks[0]) / HZ - server - ours)
                results[s].append(r)
                note = ''
                if r['non2xx'] or r['errors']:
                    note = f' ({r["non2xx"]} non-2xx; {r["errors"]})'
                print(f'| {rnd + 1} | {s} | {r["rps"]:,.0f}{note} | {r["p99_ms"]:.2f} | '
                      f'{r["origin"]} | {r["server_cpu"]:.1f} | {r["other_cpu"]:.1f} |', flush=True)
        print()
        print('| system | median requests/s | min–max | median p99 (ms) | p99 min–max |')
        print('|---|---|---|---|---|')
        for s in systems:
            rps = [r['rps'] for r in results[s]]
            p99 = [r['p99_ms'] for r in results[s]]
            print(f'| {s} | {statistics.median(rps):,.0f} | {min(rps):,.0f}–{max(rps):,.0f} | '
                  f'{statistics.median(p99):.2f} | {min(p99):.2f}–{max(p99):.2f} |')
        if 'braid' in results and 'nginx' in results:
            ratios = [b['rps'] / n['rps'] for b, n in zip(results['braid'], results['nginx'])]
            print()
            print('braid-proxy/nginx requests/s per round: '
                  + ', '.join(f'{x:.2f}' for x in ratios)
                  + f'; median {statistics.median(ratios):.2f}')
        if 'braid' in results and 'before' in results:
            ratios = [b['rps'] / n['rps'] for b, n in zip(results['braid'], results['before'])]
            print('braid-proxy/before requests/s per round: '
                  + ', '.join(f'{x:.2f}' for x in ratios)
                  + f'; median {statistics.median(ratios):.2f}')
    finally:
        for p, _ in procs.values():
            stop(p)
        origin.shutdown()
        if args.keep:
            print(f'kept {workdir}', file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == '__main__':
    main()
