#!/usr/bin/env python3
"""Delivery cost against the peers (issue 20, item 4): braid-proxy, Nchan, Pushpin.

    cargo build --release --bin braid-proxy --examples
    python3 bench/peers.py                  # full run, about 4 minutes
    python3 bench/peers.py --quick          # a few hundred subscribers, seconds per run
    python3 bench/peers.py --systems braid --braid-arg=--workers=1   # braid-proxy with a flag
    python3 bench/peers.py --quick --systems braid --bin-dir target/debug   # CI smoke

Installs nothing: Nchan needs the Debian packages nginx and
libnginx-mod-nchan, Pushpin the package pushpin (it brings condure and
zurl). Each system runs on loopback pinned to core 0 (`taskset -c 0`;
nginx with one worker, Pushpin's runner and every process it starts), the
load generator (examples/fanout.rs) pinned to core 1. A fresh server for
each scenario:

  idle    N idle subscriptions: RSS per subscription (VmRSS summed over the
          server's processes: nginx master + worker; pushpin's runner,
          condure, zurl, pushpin-proxy and pushpin-handler)
  fanout  N subscribers on one resource, U updates of about 100 bytes at
          R/s: latency p50/p99/max from the scheduled publish time to the
          update's arrival in the subscriber's socket (the kernel's receive
          stamp, SO_TIMESTAMPNS), the p99 to the generator's read of it,
          deliveries per server CPU-second, missing (and collapsed, for
          braid-proxy)
  stall   S subscribers stop reading while U updates of 50 KB are published,
          then read again: stale updates read before the current one

Writes into --out (default bench/results/<full|quick>): <system>-<scenario>.json
and .log (the generator's report), latency.csv (percentile curve per
system), latency.png, table.md (the table with the braid-proxy / peer
ratios). Exits non-zero if a run failed or a fan-out delivered nothing.

--tls runs the same scenarios with every subscriber over TLS (HTTP/1.1 by
ALPN, a full handshake each, rustls on the generator's side): a CA and a
server certificate for localhost/127.0.0.1 are made in the work directory
(`fanout --write-certs`); braid-proxy gets its own from the generator
(`fanout --tls`), nginx listens with `ssl` on the subscribers' port
(`ssl_certificate`, `ssl_protocols TLSv1.2 TLSv1.3`, nginx's defaults
otherwise) and plain on a second port for the publisher's POSTs. Over TLS
the latency is to the generator's read of the decrypted update (no kernel
receive stamp can be tied to an update). Pushpin is left out over TLS.
Default --out: bench/results/tls-<full|quick>.
"""
import argparse
import csv
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import plot_latency  # noqa: E402

NCHAN_PORT, PUSHPIN_PORT, PUSHPIN_PUBLISH, ORIGIN_PORT = 18201, 18202, 5561, 18210
NCHAN_PUBLISH_PORT = 18203  # nginx's plain listener for the POSTs under --tls
NCHAN_MODULE = '/usr/lib/nginx/modules/ngx_nchan_module.so'
NOFILE = 20000
PUSHPIN_LOG_LEVEL = 1  # 2 (info) with --keep

NGINX_CONF = """daemon off;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
load_module {module};
events {{ worker_connections {nofile}; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  client_max_body_size 1m;
  client_body_buffer_size 128k;
  server {{
    listen 127.0.0.1:{port}{ssl} backlog=4096;
{tls}    location = /sub {{
      nchan_subscriber http-raw-stream;
      nchan_channel_id doc;
      nchan_subscriber_first_message newest;
      nchan_subscriber_timeout 0;
    }}
    location = /pub {{
      nchan_publisher;
      nchan_channel_id doc;
      nchan_message_buffer_length 200;
    }}
  }}
}}
"""


def fail(msg):
    print(f'peers.py: {msg}', file=sys.stderr)
    sys.exit(1)


def check_prerequisites(systems, bin_dir):
    missing = []
    if 'nchan' in systems and not (shutil.which('nginx') and os.path.exists(NCHAN_MODULE)):
        missing += ['nginx', 'libnginx-mod-nchan']
    if 'pushpin' in systems and not all(shutil.which(b) for b in ('pushpin', 'condure', 'zurl')):
        missing += ['pushpin']
    if missing:
        fail('missing ' + ', '.join(missing) + ': apt-get install -y ' + ' '.join(missing))
    for b in ('braid-proxy', 'examples/fanout'):
        if not os.access(os.path.join(bin_dir, b), os.X_OK):
            fail(f'{bin_dir}/{b} not built: cargo build --release --bin braid-proxy --examples')
    if not shutil.which('taskset'):
        fail('taskset (util-linux) is required')


def wait_port(port, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(('127.0.0.1', port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


# Under --tls: the subscribers' listener speaks TLS (nginx's defaults but
# the protocols), a plain one takes the publisher's POSTs.
NGINX_TLS = """    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_protocols TLSv1.2 TLSv1.3;
    listen 127.0.0.1:{publish_port};
"""


def start_nchan(workdir, certs=None):
    d = os.path.join(workdir, 'nginx')
    os.makedirs(os.path.join(d, 'body'), exist_ok=True)
    conf = os.path.join(d, 'nginx.conf')
    tls = ''
    if certs:
        tls = NGINX_TLS.format(cert=certs['cert'], key=certs['key'], publish_port=NCHAN_PUBLISH_PORT)
    with open(conf, 'w') as f:
        f.write(NGINX_CONF.format(dir=d, module=NCHAN_MODULE, port=NCHAN_PORT, nofile=NOFILE,
                                  ssl=' ssl' if certs else '', tls=tls))
    p = subprocess.Popen(['taskset', '-c', '0', 'nginx', '-c', conf, '-p', d],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=open(os.path.join(d, 'stderr.log'), 'w'))
    if not wait_port(NCHAN_PORT) or (certs and not wait_port(NCHAN_PUBLISH_PORT)):
        stop(p)
        fail(f'nginx did not listen on {NCHAN_PORT}; see {d}/error.log')
    if certs:
        return p, ['--target', f'127.0.0.1:{NCHAN_PORT}', '--tls', '--tls-ca', certs['ca'],
                   '--publish', f'127.0.0.1:{NCHAN_PUBLISH_PORT}']
    return p, ['--target', f'127.0.0.1:{NCHAN_PORT}']


def start_pushpin(workdir):
    d = os.path.join(workdir, 'pushpin')
    for sub in ('run', 'log'):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    with open(os.path.join(d, 'routes'), 'w') as f:
        f.write(f'* 127.0.0.1:{ORIGIN_PORT}\n')
    out = []
    section = None
    # The Debian config, with this run's directories, zurl started by the
    # runner (pushpin-proxy needs it to reach the origin), and the
    # handler's delivery rate limit (message_rate=2500/s by default) raised
    # so that it does not throttle 100,000 deliveries a second.
    for line in open('/etc/pushpin/pushpin.conf'):
        key = line.split('=', 1)[0].strip()
        if line.startswith('['):
            section = line.strip()
        if key == 'rundir':
            line = f'rundir={d}/run\n'
        elif key == 'logdir':
            line = f'logdir={d}/log\n'
        elif key == 'services':
            line = 'services=condure,zurl,pushpin-proxy,pushpin-handler\n'
        elif key == 'routesfile':
            line = f'routesfile={d}/routes\n'
        elif key == 'client_maxconn':
            line = 'client_maxconn=50000\n'
        elif key == 'message_rate':
            line = 'message_rate=10000000\n'
        elif key == 'message_hwm':
            line = 'message_hwm=10000000\n'
        elif key == 'log_level':
            line = f'log_level={PUSHPIN_LOG_LEVEL}\n'
        out.append(line)
        if section == '[proxy]' and line.startswith('[proxy]'):
            out.append('zurl_out_specs=ipc://{rundir}/{ipc_prefix}zurl-in\n'
                       'zurl_out_stream_specs=ipc://{rundir}/{ipc_prefix}zurl-in-stream\n'
                       'zurl_in_specs=ipc://{rundir}/{ipc_prefix}zurl-out\n')
    conf = os.path.join(d, 'pushpin.conf')
    with open(conf, 'w') as f:
        f.writelines(out)
    p = subprocess.Popen(['taskset', '-c', '0', 'pushpin', '--config', conf,
                          '--port', f'127.0.0.1:{PUSHPIN_PORT}'],
                         start_new_session=True, stdout=open(os.path.join(d, 'runner.log'), 'w'),
                         stderr=subprocess.STDOUT)
    if not (wait_port(PUSHPIN_PORT) and wait_port(PUSHPIN_PUBLISH)):
        stop(p)
        fail(f'pushpin did not listen on {PUSHPIN_PORT} and {PUSHPIN_PUBLISH}; see {d}/log')
    time.sleep(1)  # the runner starts the proxy and handler after condure
    return p, ['--target', f'127.0.0.1:{PUSHPIN_PORT}',
               '--publish', f'127.0.0.1:{PUSHPIN_PUBLISH}',
               '--origin', f'127.0.0.1:{ORIGIN_PORT}']


def stop(p):
    """Ends a server this script started: its own process group, by id."""
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
    # The runner's children share its group; give them a moment to go.
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(system, scenario, params, bin_dir, out_dir, workdir, braid_args=(), certs=None):
    name = f'{system}-{scenario}'
    gen = [os.path.join(bin_dir, 'examples/fanout'), '--system', system, '--scenario', scenario,
           '--json', os.path.join(out_dir, name + '.json')] + params
    server = None
    if system == 'braid':
        gen += ['--proxy', os.path.join(bin_dir, 'braid-proxy'), '--proxy-cpu', '0']
        if certs:
            gen += ['--tls']  # the generator makes braid-proxy's certificate
        for arg in braid_args:
            gen += ['--proxy-arg', arg]
    elif system == 'nchan':
        server, extra = start_nchan(workdir, certs)
        gen += extra + ['--server-pid', str(server.pid)]
    else:
        server, extra = start_pushpin(workdir)
        gen += extra + ['--server-pid', str(server.pid)]
    print(f'== {name}: ' + ' '.join(gen[1:]), flush=True)
    try:
        with open(os.path.join(out_dir, name + '.log'), 'w') as log:
            r = subprocess.run(['taskset', '-c', '1'] + gen, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=900)
            log.write(r.stdout)
            print(r.stdout, end='', flush=True)
    finally:
        stop(server)
    time.sleep(1)
    path = os.path.join(out_dir, name + '.json')
    if r.returncode != 0 or not os.path.exists(path):
        print(f'peers.py: {name} failed (exit {r.returncode})', file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


LABEL = {'braid': 'braid-proxy', 'nchan': 'Nchan', 'pushpin': 'Pushpin'}


def fmt(v, digits=1):
    if v is None:
        return 'n/a'
    if isinstance(v, float):
        if v != v:
            return 'n/a'
        if abs(v) >= 1000:
            return f'{v:,.0f}'
        return f'{v:.{digits}f}'
    return f'{v:,}'


def write_table(out_dir, text, braid_args, written):
    """table.md in out_dir (headed by braid-proxy's extra arguments, if
    any), printed too, and what the run wrote."""
    if braid_args:
        text = f"braid-proxy ran with: {' '.join(braid_args)}\n\n" + text
    with open(os.path.join(out_dir, 'table.md'), 'w') as f:
        f.write(text)
    print()
    print(text)
    print(f'written: {out_dir}/{{{written}}}')


def make_certs(bin_dir, workdir):
    """ca.pem, cert.pem and key.pem for nginx (fanout --write-certs)."""
    d = os.path.join(workdir, 'certs')
    subprocess.run([os.path.join(bin_dir, 'examples/fanout'), '--write-certs', d],
                   check=True, stdout=subprocess.DEVNULL)
    return {k: os.path.join(d, f'{k}.pem') for k in ('ca', 'cert', 'key')}


# Over TLS: the latency is to the generator's read of the decrypted update.
TLS_LABELS = {
    'fan-out: latency p50 (ms, to arrival)': "fan-out: latency p50 (ms, to the generator's read, decrypted)",
    'fan-out: latency p99 (ms, to arrival)': "fan-out: latency p99 (ms, to the generator's read, decrypted)",
    'fan-out: latency max (ms, to arrival)': "fan-out: latency max (ms, to the generator's read, decrypted)",
}


def table(results, systems, scenarios, tls=False):
    rows = [
        ('idle: RSS per subscription (KiB)', 'idle', 'rss_per_sub_kib', 'low', 2),
        ('idle: server processes counted', 'idle', 'processes', None, 0),
        ('idle: subscriptions refused', 'idle', 'refused', 'low', 0),
        ('fan-out: latency p50 (ms, to arrival)', 'fanout', 'p50_ms', 'low', 1),
        ('fan-out: latency p99 (ms, to arrival)', 'fanout', 'p99_ms', 'low', 1),
        ('fan-out: latency max (ms, to arrival)', 'fanout', 'max_ms', 'low', 1),
        ("fan-out: latency p99 (ms, to the generator's read)", 'fanout', 'read_p99_ms', 'low', 1),
        ('fan-out: deliveries per server CPU-second', 'fanout', 'deliveries_per_cpu_sec', 'high', 0),
        ('fan-out: server CPU-seconds', 'fanout', 'server_cpu_secs', 'low', 2),
        ("fan-out: the generator's CPU-seconds", 'fanout', 'generator_cpu_secs', None, 2),
        ('fan-out: deliveries / expected', 'fanout', None, None, 0),
        ('fan-out: subscriptions refused', 'fanout', 'refused', 'low', 0),
        ('fan-out: missing', 'fanout', 'missing', 'low', 0),
        ('fan-out: collapsed', 'fanout', 'collapsed', 'low', 0),
        ('stall: stale updates read before the current one (median)', 'stall', 'stale_median', 'low', 0),
        ('stall: stale updates (max)', 'stall', 'stale_max', 'low', 0),
        ('stall: bytes read after resuming (median)', 'stall', 'bytes_after_resume_median', 'low', 0),
        ('stall: readers that never got the current one', 'stall', 'subscribers_without_last', 'low', 0),
    ]
    if tls:
        rows = [(TLS_LABELS.get(r[0], r[0]),) + r[1:] for r in rows
                if r[2] != 'read_p99_ms']  # the same as the p99 row over TLS
        rows.insert(0, ('TLS negotiated (version, suite, group, ALPN)', 'fanout', 'tls', None, 0))
    peers = [s for s in systems if s != 'braid']
    head = ['metric'] + [LABEL[s] for s in systems]
    if 'braid' in systems:
        head += [f'braid-proxy / {LABEL[s]}' for s in peers]
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for label, scen, key, _, digits in rows:
        if scen not in scenarios:
            continue
        vals = {}
        cells = [label]
        for s in systems:
            r = results.get((s, scen))
            if r is None:
                cells.append('failed')
                vals[s] = None
            elif key is None:
                cells.append(f"{fmt(r.get('deliveries'))} / {fmt(r.get('expected_deliveries'))}")
                vals[s] = None
            elif isinstance(r.get(key), str):
                cells.append(r[key])
                vals[s] = None
            else:
                vals[s] = r.get(key)
                cells.append(fmt(vals[s], digits))
        if 'braid' in systems:
            for s in peers:
                a, b = vals.get('braid'), vals.get(s)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b and a == a and b == b:
                    cells.append(f'{a / b:.2f}')
                else:
                    cells.append('')
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def goals(results):
    """Issue 20's goals for braid-proxy, against Nchan where it ran."""
    b_idle, b_fan = results.get(('braid', 'idle')), results.get(('braid', 'fanout'))
    n_idle, n_fan = results.get(('nchan', 'idle')), results.get(('nchan', 'fanout'))
    out = []

    def line(ok, text):
        out.append(f"- {'met' if ok else 'MISSED'}: {text}")
    if b_idle:
        rss = b_idle['rss_per_sub_kib']
        if n_idle:
            line(rss <= n_idle['rss_per_sub_kib'],
                 f"RSS per idle subscription {rss:.2f} KiB <= Nchan's {n_idle['rss_per_sub_kib']:.2f} KiB")
        line(rss <= 8, f'RSS per idle subscription {rss:.2f} KiB <= 8 KiB')
    if b_fan:
        p99 = b_fan['p99_ms']
        if n_fan:
            line(p99 <= n_fan['p99_ms'], f"p99 {p99:.1f} ms <= Nchan's {n_fan['p99_ms']:.1f} ms")
        line(p99 <= 50, f'p99 {p99:.1f} ms <= 50 ms')
        if n_fan:
            d, nd = b_fan['deliveries_per_cpu_sec'], n_fan['deliveries_per_cpu_sec']
            line(d >= 1.2 * nd, f"deliveries per CPU-second {d:,.0f} >= 1.2 x Nchan's {nd:,.0f} ({d / nd:.2f} x)")
            out.append(f"- the aim, 2 x Nchan's deliveries per CPU-second: "
                       f"{'reached' if d >= 2 * nd else 'not reached'} ({d / nd:.2f} x)")
        line(b_fan['missing'] == 0, f"nothing missing ({b_fan['missing']} missing, "
             f"{b_fan['collapsed']} collapsed)")
    return '\n'.join(out) + '\n'


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help='a few hundred subscribers, seconds per run')
    ap.add_argument('--systems', default='braid,nchan,pushpin')
    ap.add_argument('--scenarios', default='idle,fanout,stall')
    ap.add_argument('--bin-dir', default=os.path.join(ROOT, 'target/release'))
    ap.add_argument('--out', default=None)
    ap.add_argument('--keep', default=None, metavar='DIR',
                    help="keep the servers' configurations and logs in DIR (default: a temporary directory)")
    ap.add_argument('--report-only', action='store_true',
                    help='run nothing: make the table, CSV and PNG from the JSON files already in --out')
    ap.add_argument('--subs', type=int, default=None, help='idle and fan-out subscribers (default 10000)')
    ap.add_argument('--braid-arg', action='append', default=[], metavar='ARG',
                    help='an argument for braid-proxy, repeatable; write --braid-arg=--workers=1')
    ap.add_argument('--rate', type=float, default=None,
                    help='fan-out updates per second (default 10)')
    ap.add_argument('--updates', type=int, default=None,
                    help='fan-out updates (default 200; 20 with --quick)')
    ap.add_argument('--tls', action='store_true',
                    help='subscribers over TLS (braid-proxy and Nchan; default --systems braid,nchan)')
    args = ap.parse_args()
    if args.tls:
        if args.systems == ap.get_default('systems'):
            args.systems = 'braid,nchan'
        elif 'pushpin' in args.systems:
            fail('--tls: Pushpin is left out over TLS (braid, nchan)')
    systems = [s.strip() for s in args.systems.split(',') if s.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(',') if s.strip()]
    for s in systems:
        if s not in LABEL:
            fail(f'unknown system {s} (braid, nchan, pushpin)')
    bin_dir = os.path.abspath(args.bin_dir)
    if not args.report_only:
        check_prerequisites(systems, bin_dir)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(NOFILE, hard) if hard != resource.RLIM_INFINITY else NOFILE
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    if args.quick:
        subs = args.subs or 300
        params = {
            'idle': ['--subs', str(subs), '--settle', '1'],
            'fanout': ['--subs', str(subs), '--updates', str(args.updates or 20),
                       '--rate', f'{args.rate or 10:g}', '--payload', '100'],
            'stall': ['--subs', '20', '--updates', '20', '--rate', '10', '--payload', '50000'],
        }
    else:
        subs = args.subs or 10000
        params = {
            'idle': ['--subs', str(subs), '--settle', '2'],
            'fanout': ['--subs', str(subs), '--updates', str(args.updates or 200),
                       '--rate', f'{args.rate or 10:g}', '--payload', '100'],
            'stall': ['--subs', '100', '--updates', '100', '--rate', '10', '--payload', '50000'],
        }
    kind = 'quick' if args.quick else 'full'
    out_dir = os.path.abspath(args.out or os.path.join(HERE, 'results', f'tls-{kind}' if args.tls else kind))
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    ok = True
    if args.keep:
        global PUSHPIN_LOG_LEVEL
        PUSHPIN_LOG_LEVEL = 2
        os.makedirs(args.keep, exist_ok=True)
    with (tempfile.TemporaryDirectory(prefix='peers-') if not args.keep
          else nullcontext(os.path.abspath(args.keep))) as workdir:
        certs = make_certs(bin_dir, workdir) if args.tls and not args.report_only else None
        for system in systems:
            for scenario in scenarios:
                if args.report_only:
                    path = os.path.join(out_dir, f'{system}-{scenario}.json')
                    if os.path.exists(path):
                        with open(path) as f:
                            results[(system, scenario)] = json.load(f)
                    continue
                r = run(system, scenario, params[scenario], bin_dir, out_dir, workdir, args.braid_arg,
                        certs)
                if r is None:
                    ok = False
                    continue
                results[(system, scenario)] = r
                if scenario == 'fanout' and not r.get('deliveries'):
                    print(f'peers.py: {system} fan-out delivered nothing', file=sys.stderr)
                    ok = False
    # The latency percentile curves.
    csv_path = os.path.join(out_dir, 'latency.csv')
    with open(csv_path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['system', 'percentile', 'latency_ms'])
        for s in systems:
            r = results.get((s, 'fanout'))
            for p, ms in (r or {}).get('curve', []):
                w.writerow([LABEL[s], f'{p:.5f}', '' if ms is None else f'{ms:.3f}'])
    fan = params['fanout']
    title = f"fan-out latency: {fan[1]} subscribers, {fan[3]} updates at {fan[5]}/s"
    if args.tls:
        title += ", over TLS (to the generator's read)"
    if any((s, 'fanout') in results for s in systems):
        plot_latency.plot(plot_latency.read_csv(csv_path), os.path.join(out_dir, 'latency.png'), title)
    text = table(results, systems, scenarios, args.tls) + '\n' + ('' if args.tls else goals(results))
    if args.tls:
        text = ('Over TLS: every subscriber a TLS connection (HTTP/1.1); latency to the '
                "generator's read of the decrypted update.\n\n") + text
    write_table(out_dir, text, args.braid_arg, 'table.md,latency.csv,latency.png,*.json,*.log')
    sys.exit(0 if ok else 1)


if __name__ == '__main__':
    main()
