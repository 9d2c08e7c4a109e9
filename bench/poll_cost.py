#!/usr/bin/env python3
"""What polling a plain origin costs it: N quiet subscribed resources behind
braid-proxy, nginx as the origin (static files with its default ETags).

    apt-get update && apt-get install -y nginx     # this script installs nothing
    cargo build --release --bin braid-proxy
    python3 bench/poll_cost.py                                     # about 5 minutes
    python3 bench/poll_cost.py --phases quiet --secs 40 \\
        --proxy-args "--poll-max-interval 1s" --out bench/results/poll-cost-fixed-1s

Everything on 127.0.0.1: nginx (one worker, `daemon off`, its own prefix in
a temporary directory) serves N files `/fileI.txt`, its access log
(`$msec` per request) giving the origin's requests per wall-clock second.
braid-proxy (`--binary`, extra flags with `--proxy-args`) runs in front of
it; N subscriptions (`GET /fileI.txt`, `Subscribe: true`, HTTP/1.1, one
connection each, asyncio raw sockets) count the `Version:` lines of their
209's chunked body. Phases (`--phases`, all by default):

  quiet    all N open, then --secs (120) of sampling: the origin's requests
           per second at 30, 60 and 90 s (5-s means ending there) and
           after 90 s (mean and the largest 1-s count); updates nobody made
           (should be 0); the proxy's RSS and CPU from /proc
  changes  --changes (20) random files rewritten one at a time (a new size
           each time: nginx's ETag is mtime-size), each after a random
           0-1 s pause: time from the write to its subscriber's update
           carrying the new version (the proxy's Version is nginx's ETag);
           max and median
  lively   one other file rewritten every second for --lively-secs (30):
           time from each write to the subscriber holding it or a newer
           one; median, p90, max; writes whose own version never came
           (superseded before a poll saw it)
  budget   a fresh proxy with --origin-rps --budget-rps (100) and the same
           --proxy-args, the N subscriptions opened again, --budget-secs
           (40) after they are all open: the largest 1-s count from the
           first subscription on, and after all were open

Targets checked: quiet after 90 s <= 350/s; a change seen within 12 s
(max); lively median <= 1.5 s; budget max 1-s count <= 1.05 x the budget.
Prints a table and writes --out/poll_cost.json (default
bench/results/poll-cost). Every phase and wait is bounded in time; nginx,
the proxy and the temporary directory go at the end, also on Ctrl-C
(--keep DIR keeps the configurations and logs).
"""
import argparse
import asyncio
import collections
import json
import os
import random
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from harness import die_with_parent  # noqa: E402
from peers import stop, wait_port  # noqa: E402

NOFILE = 65536
OPEN_TIMEOUT = 150.0     # all N subscriptions open (under a budget: N / rps plus)
CHANGE_TIMEOUT = 30.0    # one change reaching its subscriber
CLK_TCK = os.sysconf('SC_CLK_TCK')

NGINX_CONF = """daemon off;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
http {{
  log_format count '$msec $status $request_method $uri';
  access_log {dir}/access.log count;
  client_body_temp_path {dir}/tmp/body;
  proxy_temp_path {dir}/tmp/proxy;
  fastcgi_temp_path {dir}/tmp/fastcgi;
  uwsgi_temp_path {dir}/tmp/uwsgi;
  scgi_temp_path {dir}/tmp/scgi;
  types {{ text/plain txt; }}
  default_type text/plain;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    root {root};
  }}
}}
"""


def fail(msg):
    print(f'poll_cost.py: {msg}', file=sys.stderr)
    sys.exit(1)


def free_port():
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
    s.close()
    return port


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def body_of(i, rev):
    # A new size with every revision: nginx's ETag is "mtime-size" in hex,
    # so two writes in one second still get two ETags.
    return (f'file {i} revision {rev}\n' + 'x' * (rev * 3) + '\n').encode()


def write_file(root, i, rev):
    """Rewrites /fileI.txt atomically; returns (time written, nginx's ETag value)."""
    path = os.path.join(root, f'file{i}.txt')
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        f.write(body_of(i, rev))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    t = time.time()
    st = os.stat(path)
    return t, f'{int(st.st_mtime):x}-{st.st_size:x}'


# ---------------------------------------------------------------- processes

class ProxyStartError(Exception):
    pass


class Procs:
    def __init__(self):
        self.nginx = None
        self.proxy = None

    def stop_all(self):
        stop(self.proxy)
        self.proxy = None
        stop(self.nginx)
        self.nginx = None


def start_nginx(procs, workdir, n, nofile):
    d = os.path.join(workdir, 'nginx')
    root = os.path.join(workdir, 'www')
    for sub in (d, root, os.path.join(d, 'tmp')):
        os.makedirs(sub, exist_ok=True)
    os.chmod(workdir, 0o755)  # nginx's worker runs as nobody
    os.chmod(root, 0o755)
    for i in range(n):
        path = os.path.join(root, f'file{i}.txt')
        with open(path, 'wb') as f:
            f.write(body_of(i, 0))
        os.chmod(path, 0o644)
    port = free_port()
    conf = os.path.join(d, 'nginx.conf')
    with open(conf, 'w') as f:
        f.write(NGINX_CONF.format(dir=d, root=root, port=port, nofile=nofile))
    procs.nginx = subprocess.Popen(
        ['nginx', '-p', d, '-c', conf, '-e', os.path.join(d, 'error.log')],
        start_new_session=True, preexec_fn=die_with_parent, stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(d, 'stderr.log'), 'w'))
    if not wait_port(port):
        fail(f'nginx did not listen on {port}; see {d}/error.log and {d}/stderr.log')
    return port, root, os.path.join(d, 'access.log')


def start_proxy(procs, binary, workdir, origin_port, extra, name):
    port, aport = free_port(), free_port()
    args = [binary, '--listen', f'127.0.0.1:{port}', '--upstream', f'http://127.0.0.1:{origin_port}',
            '--admin-listen', f'127.0.0.1:{aport}'] + extra
    log = os.path.join(workdir, f'proxy-{name}.log')
    procs.proxy = subprocess.Popen(args, start_new_session=True, preexec_fn=die_with_parent,
                                   stdout=open(log, 'w'), stderr=subprocess.STDOUT)
    if not (wait_port(port) and wait_port(aport)):
        code = procs.proxy.poll()
        stop(procs.proxy)
        procs.proxy = None
        with open(log) as f:
            tail = f.read()[-2000:]
        raise ProxyStartError(f'braid-proxy did not listen (exit {code}): {" ".join(args)}\n{tail}')
    return port, aport, args


def proc_stats(pid):
    """RSS, peak RSS (KiB), CPU-seconds (user + system) and threads of pid."""
    out = {}
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                k, _, v = line.partition(':')
                if k in ('VmRSS', 'VmHWM'):
                    out[k] = int(v.split()[0])
                elif k == 'Threads':
                    out['threads'] = int(v)
        with open(f'/proc/{pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
        out['cpu_secs'] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    except OSError:
        pass
    return out


def admin_get(aport, path):
    try:
        with urllib.request.urlopen(f'http://127.0.0.1:{aport}{path}', timeout=10) as r:
            return r.read().decode()
    except OSError as e:
        return None


def metrics_of(aport):
    """braid_proxy_* counters and gauges about polling and the origin."""
    text = admin_get(aport, '/metrics') or ''
    out = {}
    for line in text.splitlines():
        if line.startswith('#') or not line.startswith('braid_proxy_'):
            continue
        name, _, value = line.rpartition(' ')
        if any(w in name for w in ('poll', 'origin', 'upstream', 'budget', 'refresh', 'subscri')):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def intervals_of(aport):
    """The poll_interval_secs of /status's resources, counted by value
    (/status lists the 500 most subscribed only)."""
    text = admin_get(aport, '/status')
    if not text:
        return None
    try:
        status = json.loads(text)
    except ValueError:
        return None
    counts = collections.Counter()

    def walk(x):
        if isinstance(x, dict):
            if 'poll_interval_secs' in x:
                v = x['poll_interval_secs']
                counts['none' if v is None else f'{v:g}'] += 1
            else:
                for v in x.values():
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(status)
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] == 'none', float(kv[0]) if kv[0] != 'none' else 0)))


# ---------------------------------------------------------------- the origin's log

class AccessLog:
    """Tails nginx's access log: requests per wall-clock second (by $msec)."""

    def __init__(self, path):
        self.path = path
        self.f = None
        self.rest = b''
        self.per_sec = collections.Counter()
        self.status = collections.Counter()
        self.lines = []  # (msec, status, uri) of the current window

    def poll(self):
        if self.f is None:
            if not os.path.exists(self.path):
                return
            self.f = open(self.path, 'rb')
        data = self.rest + self.f.read()
        lines = data.split(b'\n')
        self.rest = lines.pop()
        for line in lines:
            parts = line.split(b' ')
            if len(parts) < 4:
                continue
            t = float(parts[0])
            self.per_sec[int(t)] += 1
            st = parts[1].decode()
            self.status[st] += 1
            self.lines.append((t, st, parts[3].decode('latin-1')))

    def series(self, t0, secs):
        base = int(t0)
        return [self.per_sec.get(base + k, 0) for k in range(secs)]


async def sample(log, until):
    """Reads the log every second until `until` (time.time())."""
    while time.time() < until:
        await asyncio.sleep(min(1.0, max(0.0, until - time.time())))
        log.poll()
    await asyncio.sleep(0.3)  # the last second's lines
    log.poll()


# ---------------------------------------------------------------- subscribers

class Sub:
    def __init__(self, i):
        self.i = i
        self.status = None
        self.error = None
        self.arrivals = []  # (time, version)
        self.event = asyncio.Event()
        self.writer = None
        self.opened_at = None


async def read_stream(sub, reader):
    buf = b''

    def feed(data):
        nonlocal buf
        buf += data
        lines = buf.split(b'\n')
        buf = lines.pop()
        for line in lines:
            if line[:8].lower() == b'version:':
                v = line[8:].strip().decode('latin-1').strip('"')
                sub.arrivals.append((time.time(), v))
                sub.event.set()
    while True:
        size_line = await reader.readuntil(b'\r\n')
        size = int(size_line.split(b';')[0], 16)
        if size == 0:
            raise EOFError('stream ended')
        data = await reader.readexactly(size + 2)
        feed(data[:-2])


async def subscribe(sub, port, path, sem, deadline):
    req = (f'GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nSubscribe: true\r\n\r\n').encode()
    try:
        async with sem:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection('127.0.0.1', port, limit=1 << 20), 10)
            sub.writer = writer
            writer.write(req)
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b'\r\n\r\n'),
                                      max(1.0, deadline - time.time()))
        lines = head.decode('latin-1').split('\r\n')
        sub.status = int(lines[0].split(' ')[1])
        headers = {}
        for line in lines[1:]:
            k, colon, v = line.partition(':')
            if colon:
                headers[k.strip().lower()] = v.strip()
        if sub.status != 209:
            sub.error = f'status {sub.status}'
            return
        if 'chunked' not in headers.get('transfer-encoding', '').lower():
            sub.error = 'not chunked'
            return
        await read_stream(sub, reader)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - recorded, counted, reported
        sub.error = f'{type(e).__name__}: {e}'[:200]
    finally:
        sub.event.set()


async def open_all(n, port, deadline):
    subs = [Sub(i) for i in range(n)]
    sem = asyncio.Semaphore(200)
    tasks = [asyncio.create_task(subscribe(s, port, f'/file{s.i}.txt', sem, deadline)) for s in subs]
    t_start = time.time()
    while time.time() < deadline:
        pending = [s for s in subs if not s.arrivals and s.error is None]
        if not pending:
            break
        await asyncio.sleep(0.1)
    t_open = time.time()
    return subs, tasks, t_start, t_open


async def close_all(subs, tasks):
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in subs:
        if s.writer is not None:
            s.writer.close()


async def wait_version(sub, version, deadline):
    """The time sub got `version`, or None by the deadline."""
    while True:
        for t, v in sub.arrivals:
            if v == version:
                return t
        left = deadline - time.time()
        if left <= 0 or sub.error is not None:
            return None
        sub.event.clear()
        try:
            await asyncio.wait_for(sub.event.wait(), left)
        except asyncio.TimeoutError:
            pass


def open_report(subs, t_start, t_open):
    errors = collections.Counter(s.error for s in subs if s.error)
    return {
        'opened': sum(1 for s in subs if s.arrivals),
        'failed': sum(1 for s in subs if s.error),
        'errors': dict(errors.most_common(5)),
        'secs_to_open_all': round(t_open - t_start, 2),
    }


# ---------------------------------------------------------------- phases

async def phase_quiet(args, procs, log, port, aport):
    print(f'== quiet: opening {args.n} subscriptions', flush=True)
    log.poll()
    log.lines = []
    subs, tasks, t_start, t_open = await open_all(args.n, port, time.time() + OPEN_TIMEOUT)
    opened = open_report(subs, t_start, t_open)
    print(f'   {opened}', flush=True)
    before = {s.i: len(s.arrivals) for s in subs}
    cpu0 = proc_stats(procs.proxy.pid).get('cpu_secs', 0)
    mark = min(90, args.secs)
    await sample(log, t_open + mark)
    cpu90 = proc_stats(procs.proxy.pid).get('cpu_secs', 0)
    intervals_90 = intervals_of(aport)
    await sample(log, t_open + args.secs)
    end = proc_stats(procs.proxy.pid)
    series = log.series(t_open, args.secs)
    opening = log.series(t_start, int(t_open - t_start) + 1)

    def mean5(t):
        xs = series[max(0, t - 5):t]
        return round(statistics.mean(xs), 1) if xs else None
    after = series[90:] if args.secs > 90 else []
    # Requests per resource after 90 s (or the last half): is any polled too often?
    cut = t_open + (90 if args.secs > 90 else args.secs / 2)
    per_uri = collections.Counter(u for t, _, u in log.lines if t >= cut)
    window = t_open + args.secs - cut
    spurious = sum(len(s.arrivals) - before[s.i] for s in subs)
    r = {
        'subscriptions': opened,
        'origin_requests_while_opening': sum(opening),
        'rps_series': series,
        'rps_5s_mean_at': {str(t): mean5(t) for t in (30, 60, 90) if t <= args.secs},
        'rps_mean_after_90s': round(statistics.mean(after), 1) if after else None,
        'rps_max_1s_after_90s': max(after) if after else None,
        'rps_min_1s_after_90s': min(after) if after else None,
        'rps_max_1s_whole': max(series) if series else None,
        'rps_mean_after_10s': round(statistics.mean(series[10:]), 1) if len(series) > 10 else None,
        'rps_mean_last_10s': round(statistics.mean(series[-10:]), 1) if series else None,
        'requests_per_resource_late_window': {
            'window_secs': round(window, 1),
            'resources_polled': len(per_uri),
            'max': max(per_uri.values()) if per_uri else 0,
            'median': statistics.median(per_uri.values()) if per_uri else 0,
            'most_polled': per_uri.most_common(3),
        },
        'updates_nobody_made': spurious,
        'proxy_end': end,
        'proxy_cpu_secs_quiet_window': round(end.get('cpu_secs', 0) - cpu0, 2),
        'proxy_cpu_share_after_90s': (round((end.get('cpu_secs', 0) - cpu90) / (args.secs - 90), 4)
                                      if args.secs > 90 else None),
        'poll_intervals_at_90s': intervals_90,
        'poll_intervals_at_end': intervals_of(aport),
        'metrics_at_end': metrics_of(aport),
    }
    return r, subs, tasks


async def phase_changes(args, log, root, subs, rng, revs):
    print(f'== changes: {args.changes} files, one at a time', flush=True)
    live = [s for s in subs if s.arrivals and s.error is None]
    picked = rng.sample(live, min(args.changes, len(live)))
    out = []
    for s in picked:
        await asyncio.sleep(rng.random())
        revs[s.i] = revs.get(s.i, 0) + 1
        t_w, etag = write_file(root, s.i, revs[s.i])
        t_seen = await wait_version(s, etag, t_w + CHANGE_TIMEOUT)
        lat = None if t_seen is None else round(t_seen - t_w, 3)
        out.append({'file': s.i, 'version': etag, 'latency_secs': lat})
        print(f'   file{s.i}.txt: {lat if lat is not None else "NOT SEEN"} s', flush=True)
        log.poll()
    lats = [c['latency_secs'] for c in out if c['latency_secs'] is not None]
    return {
        'changes': out,
        'not_seen': sum(1 for c in out if c['latency_secs'] is None),
        'max_secs': max(lats) if lats else None,
        'median_secs': round(statistics.median(lats), 3) if lats else None,
        'p90_secs': round(percentile(lats, 90), 3) if lats else None,
    }, {s.i for s in picked}


async def phase_lively(args, log, root, subs, rng, revs, exclude):
    live = [s for s in subs if s.arrivals and s.error is None and s.i not in exclude]
    s = rng.choice(live)
    print(f'== lively: file{s.i}.txt rewritten every second for {args.lively_secs} s', flush=True)
    n0 = len(s.arrivals)
    writes = []  # (time, version)
    t0 = time.time() + 0.5
    for k in range(args.lively_secs):
        await asyncio.sleep(max(0.0, t0 + k - time.time()))
        revs[s.i] = revs.get(s.i, 0) + 1
        writes.append(write_file(root, s.i, revs[s.i]))
        log.poll()
    await wait_version(s, writes[-1][1], time.time() + 15)
    index = {v: k for k, (_, v) in enumerate(writes)}
    lat = [None] * len(writes)
    own = set()
    for t, v in s.arrivals[n0:]:
        j = index.get(v)
        if j is None:
            continue
        own.add(j)
        for k in range(j + 1):
            if lat[k] is None:
                lat[k] = round(t - writes[k][0], 3)
    seen = [x for x in lat if x is not None]
    rest = [x for x in lat[1:] if x is not None]
    return {
        'file': s.i,
        'writes': len(writes),
        'latency_secs': lat,
        'not_seen': sum(1 for x in lat if x is None),
        'versions_delivered': len(own),
        'superseded_before_seen': len(writes) - len(own),
        'updates_received': len(s.arrivals) - n0,
        'median_secs': round(statistics.median(seen), 3) if seen else None,
        'p90_secs': round(percentile(seen, 90), 3) if seen else None,
        'max_secs': max(seen) if seen else None,
        'median_secs_without_first': round(statistics.median(rest), 3) if rest else None,
        'p90_secs_without_first': round(percentile(rest, 90), 3) if rest else None,
    }


async def phase_budget(args, procs, log, workdir, origin_port):
    extra = args.proxy_args + ['--origin-rps', f'{args.budget_rps:g}']
    port, aport, argv = start_proxy(procs, args.binary, workdir, origin_port, extra, 'budget')
    print(f'== budget: {" ".join(argv[1:])}; opening {args.n} subscriptions', flush=True)
    log.poll()
    log.lines = []
    deadline = time.time() + OPEN_TIMEOUT
    sampler = asyncio.create_task(sample(log, deadline + args.budget_secs))
    subs, tasks, t_start, t_open = await open_all(args.n, port, deadline)
    opened = open_report(subs, t_start, t_open)
    print(f'   {opened}', flush=True)
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    await sample(log, t_open + args.budget_secs)
    whole = log.series(t_start, int(t_open + args.budget_secs - t_start))
    after = log.series(t_open, args.budget_secs)
    # Whole-second buckets cut a spread-even stream arbitrarily; also the
    # densest one-second window anywhere, from the timestamps.
    ts = sorted(t for t, _, _ in log.lines)
    dense, j = 0, 0
    for i, t in enumerate(ts):
        while ts[j] < t - 1.0:
            j += 1
        dense = max(dense, i - j + 1)
    over = [(k, c) for k, c in enumerate(whole) if c > args.budget_rps * 1.05]
    base = int(t_start)
    by_status = collections.defaultdict(collections.Counter)
    for t, st, _ in log.lines:
        by_status[int(t) - base][st] += 1
    over_status = {str(k): dict(by_status[k]) for k, _ in over}
    r = {
        'proxy_args': argv[1:],
        'subscriptions': opened,
        'rps_series_from_first_subscription': whole,
        'rps_max_1s': max(whole) if whole else None,
        'rps_max_1s_after_open': max(after) if after else None,
        'rps_mean_after_open': round(statistics.mean(after), 1) if after else None,
        'densest_sliding_1s_window': dense,
        'seconds_over_105pct': over,
        'statuses_in_seconds_over': over_status,
        'proxy_end': proc_stats(procs.proxy.pid),
        'poll_intervals_at_end': intervals_of(aport),
        'metrics_at_end': metrics_of(aport),
    }
    await close_all(subs, tasks)
    return r


async def run(args, procs, workdir):
    rng = random.Random(args.seed)
    origin_port, root, access = start_nginx(procs, workdir, args.n,
                                            resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    log = AccessLog(access)
    report = {'n': args.n, 'binary': args.binary, 'proxy_args': args.proxy_args, 'seed': args.seed,
              'started': time.strftime('%Y-%m-%d %H:%M:%S'), 'nproc': os.cpu_count(),
              'loadavg_start': os.getloadavg()}
    phases = args.phases
    revs = {}
    if any(p in phases for p in ('quiet', 'changes', 'lively')):
        port, aport, argv = start_proxy(procs, args.binary, workdir, origin_port, args.proxy_args, 'main')
        print(f'== proxy: {" ".join(argv)}', flush=True)
        report['main_proxy_args'] = argv[1:]
        quiet, subs, tasks = await phase_quiet(args, procs, log, port, aport)
        if 'quiet' in phases:
            report['quiet'] = quiet
        else:
            report['opened'] = quiet['subscriptions']
        changed = set()
        if 'changes' in phases:
            report['changes'], changed = await phase_changes(args, log, root, subs, rng, revs)
        if 'lively' in phases:
            report['lively'] = await phase_lively(args, log, root, subs, rng, revs, changed)
        report['main_proxy_end'] = proc_stats(procs.proxy.pid)
        report['main_metrics_end'] = metrics_of(aport)
        await close_all(subs, tasks)
        stop(procs.proxy)
        procs.proxy = None
        await asyncio.sleep(1)
    if 'budget' in phases:
        try:
            report['budget'] = await phase_budget(args, procs, log, workdir, origin_port)
        except ProxyStartError as e:
            print(f'poll_cost.py: budget phase skipped: {e}', file=sys.stderr)
            report['budget_error'] = str(e)
    log.poll()
    report['origin_statuses'] = dict(log.status)
    report['loadavg_end'] = os.getloadavg()
    return report


# ---------------------------------------------------------------- output

def fmt(v):
    if v is None:
        return 'n/a'
    if isinstance(v, float):
        return f'{v:,.1f}' if abs(v) >= 100 else f'{v:.2f}'
    return f'{v:,}' if isinstance(v, int) else str(v)


def table(report, args):
    rows, goals = [], []

    def goal(ok, text):
        goals.append(f"- {'met' if ok else 'MISSED'}: {text}")
    q = report.get('quiet')
    if q:
        so = q['subscriptions']
        rows += [
            ('subscriptions open / failed', f"{so['opened']:,} / {so['failed']:,} in {so['secs_to_open_all']} s"),
            ('origin requests in the seconds of opening', fmt(q['origin_requests_while_opening'])),
        ]
        for t, v in q['rps_5s_mean_at'].items():
            rows.append((f'origin req/s at {t} s (5-s mean)', fmt(v)))
        cs = q['proxy_cpu_share_after_90s']
        share = 'n/a' if cs is None else f'{100 * cs:.1f}%'
        rows += [
            ('origin req/s after 90 s: mean', fmt(q['rps_mean_after_90s'])),
            ('origin req/s after 90 s: max 1-s / min 1-s',
             f"{fmt(q['rps_max_1s_after_90s'])} / {fmt(q['rps_min_1s_after_90s'])}"),
            ('origin req/s: max 1-s over the whole window', fmt(q['rps_max_1s_whole'])),
            ('origin req/s: mean from 10 s on', fmt(q['rps_mean_after_10s'])),
            ('requests per resource, late window (median / max)',
             f"{q['requests_per_resource_late_window']['median']} / {q['requests_per_resource_late_window']['max']}"
             f" in {q['requests_per_resource_late_window']['window_secs']} s"),
            ('updates nobody made', fmt(q['updates_nobody_made'])),
            ('proxy RSS (MiB) / peak', f"{q['proxy_end'].get('VmRSS', 0) / 1024:.1f} / "
                                       f"{q['proxy_end'].get('VmHWM', 0) / 1024:.1f}"),
            ('proxy CPU-s in the quiet window / share of a core after 90 s',
             f"{q['proxy_cpu_secs_quiet_window']} / " + share),
        ]
        if q['rps_mean_after_90s'] is not None:
            goal(q['rps_mean_after_90s'] <= 350,
                 f"(a) quiet origin rate after 90 s <= 350/s, mean ({q['rps_mean_after_90s']})")
            goal(q['rps_max_1s_after_90s'] <= 350,
                 f"(a) quiet origin rate after 90 s <= 350/s, every 1-s count (max {q['rps_max_1s_after_90s']})")
    c = report.get('changes')
    if c:
        rows += [('change seen: median / p90 / max (s)',
                  f"{fmt(c['median_secs'])} / {fmt(c['p90_secs'])} / {fmt(c['max_secs'])}"),
                 ('changes not seen', f"{c['not_seen']} of {len(c['changes'])}")]
        goal(c['not_seen'] == 0 and c['max_secs'] is not None and c['max_secs'] <= 12,
             f"(b) every change seen within 12 s (max {c['max_secs']}, {c['not_seen']} not seen)")
    lv = report.get('lively')
    if lv:
        rows += [('lively (1 write/s): median / p90 / max (s)',
                  f"{fmt(lv['median_secs'])} / {fmt(lv['p90_secs'])} / {fmt(lv['max_secs'])}"),
                 ('lively without the first write: median / p90 (s)',
                  f"{fmt(lv['median_secs_without_first'])} / {fmt(lv['p90_secs_without_first'])}"),
                 ('lively: versions delivered / writes (superseded)',
                  f"{lv['versions_delivered']} / {lv['writes']} ({lv['superseded_before_seen']})")]
        goal(lv['median_secs'] is not None and lv['median_secs'] <= 1.5,
             f"(c) a resource changing every second seen within 1.5 s at the median ({lv['median_secs']})")
    b = report.get('budget')
    if b:
        so = b['subscriptions']
        rows += [
            (f'budget {args.budget_rps:g}: subscriptions open / failed',
             f"{so['opened']:,} / {so['failed']:,} in {so['secs_to_open_all']} s"),
            (f'budget {args.budget_rps:g}: max 1-s (from first subscription / after open)',
             f"{fmt(b['rps_max_1s'])} / {fmt(b['rps_max_1s_after_open'])}"),
            (f'budget {args.budget_rps:g}: densest sliding 1-s window', fmt(b['densest_sliding_1s_window'])),
            (f'budget {args.budget_rps:g}: mean req/s after open', fmt(b['rps_mean_after_open'])),
        ]
        goal(b['rps_max_1s'] is not None and b['rps_max_1s'] <= 1.05 * args.budget_rps,
             f"(d) with --origin-rps {args.budget_rps:g} no second over {1.05 * args.budget_rps:g} "
             f"(max {b['rps_max_1s']})")
    w = max(len(r[0]) for r in rows) if rows else 10
    lines = [f"| {'measure'.ljust(w)} | value |", f"|{'-' * (w + 2)}|---|"]
    lines += [f'| {k.ljust(w)} | {v} |' for k, v in rows]
    return '\n'.join(lines) + '\n\n' + '\n'.join(goals) + '\n'


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--binary', default=os.path.join(ROOT, 'target/release/braid-proxy'))
    ap.add_argument('--proxy-args', default='', help='extra flags for braid-proxy, one string')
    ap.add_argument('-n', '--n', type=int, default=3000, help='files and subscriptions (3000)')
    ap.add_argument('--secs', type=int, default=120, help='quiet sampling after all are open (120)')
    ap.add_argument('--changes', type=int, default=20)
    ap.add_argument('--lively-secs', type=int, default=30)
    ap.add_argument('--budget-rps', type=float, default=100)
    ap.add_argument('--budget-secs', type=int, default=40)
    ap.add_argument('--phases', default='quiet,changes,lively,budget')
    ap.add_argument('--seed', type=int, default=None)
    ap.add_argument('--out', default=os.path.join(HERE, 'results', 'poll-cost'))
    ap.add_argument('--keep', default=None, metavar='DIR', help='keep configurations and logs in DIR')
    args = ap.parse_args()
    args.proxy_args = shlex.split(args.proxy_args)
    args.phases = [p.strip() for p in args.phases.split(',') if p.strip()]
    for p in args.phases:
        if p not in ('quiet', 'changes', 'lively', 'budget'):
            fail(f'unknown phase {p} (quiet, changes, lively, budget)')
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    args.binary = os.path.abspath(args.binary)
    if not shutil.which('nginx'):
        fail('nginx is missing: apt-get update && apt-get install -y nginx')
    if not os.access(args.binary, os.X_OK):
        fail(f'{args.binary} not built: cargo build --release --bin braid-proxy')
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    if args.n + 200 > max(soft, want):
        fail(f'RLIMIT_NOFILE {max(soft, want)} is too low for {args.n} subscriptions')

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    procs = Procs()
    if args.keep:
        workdir = os.path.abspath(args.keep)
        os.makedirs(workdir, exist_ok=True)
    else:
        workdir = tempfile.mkdtemp(prefix='poll-cost-')
    report = None
    try:
        report = asyncio.run(run(args, procs, workdir))
    except KeyboardInterrupt:
        print('poll_cost.py: interrupted', file=sys.stderr)
    except ProxyStartError as e:
        print(f'poll_cost.py: {e}', file=sys.stderr)
    finally:
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if report is None:
        sys.exit(1)
    os.makedirs(args.out, exist_ok=True)
    text = table(report, args)
    report['table'] = text
    path = os.path.join(args.out, 'poll_cost.json')
    with open(path, 'w') as f:
        json.dump(report, f, indent=1)
    print()
    if args.proxy_args:
        print(f"braid-proxy ran with: {' '.join(args.proxy_args)}\n")
    print(text)
    print(f'written: {path}')
    sys.exit(0 if 'MISSED' not in text else 3)


if __name__ == '__main__':
    main()
