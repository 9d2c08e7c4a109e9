#!/usr/bin/env python3
"""TLS handshakes per core-second: braid-proxy against nginx (issue 47).

    cargo build --release --bin braid-proxy --examples
    python3 bench/tls.py                         # 3 rounds of 10 s each, about 1.5 minutes
    python3 bench/tls.py --rounds 1 --secs 3     # a quick look
    python3 bench/tls.py --kx x25519,default     # also with rustls's default groups (X25519MLKEM768)
    python3 bench/tls.py --resume                # returning clients: sessions resumed by ticket

Installs nothing (nginx is the Debian package; no module needed). Makes a
CA and a server certificate for localhost/127.0.0.1 (`fanout --write-certs`,
ECDSA P-256 unless --key rsa2048), then runs braid-proxy and nginx
alternately, a fresh server each run, pinned to core 0 (`taskset -c 0`;
nginx with one worker), and examples/handshakes.rs on core 1: --conns loops
each opening TLS connections as fast as they can (a full handshake each,
no resumption, ALPN http/1.1), sending one GET with `Connection: close` and
reading the answer to its end. The resource is one the server answers by
itself: braid-proxy's `GET /.well-known/braid-proxy/purges` (the purge
feed's plain answer to a trusted downstream, 65 bytes, no upstream work),
nginx a `return 200` of the same 65 bytes at the same path.

  braid-proxy  --tls-cert/--tls-key, RUST_LOG=warn (no access line), an
               upstream that is never asked
  nginx        worker_processes 1; listen ... ssl; ssl_certificate(_key);
               ssl_protocols TLSv1.2 TLSv1.3; access_log off; nginx's
               defaults otherwise (no session cache, tickets on)

Per run: handshakes per server CPU-second (utime+stime from /proc over the
measured window, summed over nginx's master and worker), per wall second,
the server's and the generator's CPU as a share of their core (a server
under about 90% was not the bottleneck: the generator was), the handshake
time p50/p99, and what was negotiated. `--verify off` (the default) spares
the generator the certificate's verification so that one core of client
can keep the server's core busy; the server's work is the same.

--resume measures returning clients instead: the generator keeps the
tickets both servers issue (nginx and braid-proxy both do by default)
and resumes with them; the report counts the
connections that resumed (`resumed` in the JSON, a row in the table).

Writes into --out (default bench/results/tls-handshakes): one JSON per run
(<system>-<kx>-<round>.json), table.md (the medians over the rounds and the
braid-proxy / nginx ratio). Exits non-zero if a run failed.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers import stop, wait_port, write_table  # noqa: E402  (the same servers' lifecycle and report)
BRAID_PORT, NGINX_PORT, NOWHERE_PORT = 18443, 18444, 18449
PATH = '/.well-known/braid-proxy/purges'
# braid-proxy's answer to a plain GET of the purge feed, which nginx sends too.
BODY = 'braid-proxy purge feed: GET with Subscribe: true (spec/tiers.md)\n'
NOFILE = 20000

NGINX_CONF = """daemon off;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections {nofile}; }}
http {{
  access_log off;
  server {{
    listen 127.0.0.1:{port} ssl backlog=4096;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_protocols TLSv1.2 TLSv1.3;
    location = {path} {{
      default_type text/plain;
      return 200 "{body}";
    }}
  }}
}}
"""

LABEL = {'braid': 'braid-proxy', 'nginx': 'nginx'}


def fail(msg):
    print(f'tls.py: {msg}', file=sys.stderr)
    sys.exit(1)


def start_braid(bin_dir, workdir, certs, braid_args):
    log = open(os.path.join(workdir, 'braid-proxy.log'), 'w')
    p = subprocess.Popen(['taskset', '-c', '0', os.path.join(bin_dir, 'braid-proxy'),
                          '--listen', f'127.0.0.1:{BRAID_PORT}',
                          '--upstream', f'http://127.0.0.1:{NOWHERE_PORT}',
                          '--tls-cert', certs['cert'], '--tls-key', certs['key']] + list(braid_args),
                         start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, RUST_LOG='warn'))
    if not wait_port(BRAID_PORT):
        stop(p)
        fail(f'braid-proxy did not listen on {BRAID_PORT}; see {workdir}/braid-proxy.log')
    return p, BRAID_PORT


def start_nginx(workdir, certs):
    d = os.path.join(workdir, 'nginx')
    os.makedirs(d, exist_ok=True)
    conf = os.path.join(d, 'nginx.conf')
    with open(conf, 'w') as f:
        f.write(NGINX_CONF.format(dir=d, port=NGINX_PORT, nofile=NOFILE, cert=certs['cert'],
                                  key=certs['key'], path=PATH, body=BODY.replace('\n', '\\n')))
    p = subprocess.Popen(['taskset', '-c', '0', 'nginx', '-c', conf, '-p', d],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=open(os.path.join(d, 'stderr.log'), 'w'))
    if not wait_port(NGINX_PORT):
        stop(p)
        fail(f'nginx did not listen on {NGINX_PORT}; see {d}/error.log')
    return p, NGINX_PORT


def run(system, kx, rnd, args, bin_dir, out_dir, workdir, certs):
    name = f'{system}-{kx}-{rnd}'
    if system == 'braid':
        server, port = start_braid(bin_dir, workdir, certs, args.braid_arg)
    else:
        server, port = start_nginx(workdir, certs)
    path = os.path.join(out_dir, name + '.json')
    gen = [os.path.join(bin_dir, 'examples/handshakes'), '--target', f'127.0.0.1:{port}',
           '--server-pid', str(server.pid), '--tls-ca', certs['ca'], '--verify', args.verify,
           '--kx', kx, '--conns', str(args.conns), '--secs', str(args.secs),
           '--warmup', str(args.warmup), '--path', PATH, '--label', f'{LABEL[system]} ({kx})',
           '--json', path] + (['--resume'] if args.resume else [])
    print(f'== {name}: ' + ' '.join(gen[1:]), flush=True)
    try:
        r = subprocess.run(['taskset', '-c', '1'] + gen, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        print(r.stdout, end='', flush=True)
        with open(os.path.join(out_dir, name + '.log'), 'w') as log:
            log.write(r.stdout)
    finally:
        stop(server)
    time.sleep(1)
    if r.returncode != 0 or not os.path.exists(path):
        print(f'tls.py: {name} failed (exit {r.returncode})', file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


def fmt(v, digits=0):
    if v is None or v != v:
        return 'n/a'
    if abs(v) >= 1000:
        return f'{v:,.0f}'
    return f'{v:.{digits}f}'


def table(results, systems, kxs, rounds):
    rows = [
        ('handshakes per server CPU-second', 'per_server_cpu_sec', 0),
        ('handshakes per wall second', 'per_wall_sec', 0),
        ("server CPU, % of its core", 'server_busy', 0),
        ("generator CPU, % of its core", 'generator_busy', 0),
        ('handshake p50 (ms)', 'handshake_p50_ms', 2),
        ('handshake p99 (ms)', 'handshake_p99_ms', 2),
        ('failed connections', 'failed', 0),
        ('resumed connections', 'resumed', 0),
    ]
    cols = [(s, kx) for kx in kxs for s in systems]
    head = ['metric'] + [f'{LABEL[s]} ({kx})' for s, kx in cols]
    pairs = [kx for kx in kxs if 'braid' in systems and 'nginx' in systems]
    head += [f'braid-proxy / nginx ({kx})' for kx in pairs]
    lines = [f'Medians over {rounds} round(s).', '',
             '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]

    def median(s, kx, key):
        vals = []
        for r in results.get((s, kx), []):
            if key == 'server_busy':
                vals.append(100 * r['server_cpu_secs'] / r['window_secs'])
            elif key == 'generator_busy':
                vals.append(100 * r['generator_cpu_secs'] / r['window_secs'])
            else:
                vals.append(r.get(key, 0))
        return statistics.median(vals) if vals else None

    for label, key, digits in rows:
        cells = [label]
        for s, kx in cols:
            cells.append(fmt(median(s, kx, key), digits))
        for kx in pairs:
            a, b = median('braid', kx, key), median('nginx', kx, key)
            ratio = key in ('per_server_cpu_sec', 'per_wall_sec', 'handshake_p50_ms', 'handshake_p99_ms')
            cells.append(f'{a / b:.2f}' if ratio and a is not None and b else '')
        lines.append('| ' + ' | '.join(cells) + ' |')
    cells = ['negotiated']
    for s, kx in cols:
        got = {r['negotiated'] for r in results.get((s, kx), [])}
        cells.append(', '.join(sorted(got)) or 'n/a')
    cells += [''] * len(pairs)
    lines.append('| ' + ' | '.join(cells) + ' |')
    cells = ['every run: per server CPU-second']
    for s, kx in cols:
        cells.append(', '.join(fmt(r['per_server_cpu_sec']) for r in results.get((s, kx), [])))
    cells += [''] * len(pairs)
    lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--rounds', type=int, default=3, help='runs of each server, alternated (default 3)')
    ap.add_argument('--secs', type=float, default=10, help='measured seconds per run (default 10)')
    ap.add_argument('--warmup', type=float, default=2, help='seconds before measuring (default 2)')
    ap.add_argument('--conns', type=int, default=32, help='concurrent connection loops (default 32)')
    ap.add_argument('--kx', default='x25519',
                    help='key exchange offers, comma-separated: x25519 (alone), default '
                         "(rustls's list, X25519MLKEM768 first); default x25519")
    ap.add_argument('--resume', action='store_true',
                    help='returning clients: resume sessions by the servers\' tickets')
    ap.add_argument('--verify', default='off', choices=['on', 'off'],
                    help="the generator verifies the server's certificate (default off)")
    ap.add_argument('--key', default='ecdsa-p256', choices=['ecdsa-p256', 'rsa2048'],
                    help="the server certificate's key (default ecdsa-p256)")
    ap.add_argument('--systems', default='braid,nginx')
    ap.add_argument('--bin-dir', default=os.path.join(ROOT, 'target/release'))
    ap.add_argument('--out', default=os.path.join(HERE, 'results', 'tls-handshakes'))
    ap.add_argument('--keep', default=None, metavar='DIR',
                    help='keep the certificates, configurations and logs in DIR')
    ap.add_argument('--braid-arg', action='append', default=[], metavar='ARG',
                    help='an argument for braid-proxy, repeatable; write --braid-arg=--workers=1')
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(',') if s.strip()]
    kxs = [k.strip() for k in args.kx.split(',') if k.strip()]
    for s in systems:
        if s not in LABEL:
            fail(f'unknown system {s} (braid, nginx)')
    bin_dir = os.path.abspath(args.bin_dir)
    for b in ('braid-proxy', 'examples/fanout', 'examples/handshakes'):
        if not os.access(os.path.join(bin_dir, b), os.X_OK):
            fail(f'{bin_dir}/{b} not built: cargo build --release --bin braid-proxy --examples')
    if 'nginx' in systems and not shutil.which('nginx'):
        fail('missing nginx: apt-get install -y nginx')
    if not shutil.which('taskset'):
        fail('taskset (util-linux) is required')
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(NOFILE, hard) if hard != resource.RLIM_INFINITY else NOFILE
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    results = {}
    ok = True
    with (tempfile.TemporaryDirectory(prefix='tls-') if not args.keep
          else nullcontext(os.path.abspath(args.keep))) as workdir:
        d = os.path.join(workdir, 'certs')
        subprocess.run([os.path.join(bin_dir, 'examples/fanout'), '--write-certs', d,
                        '--key', args.key], check=True, stdout=subprocess.DEVNULL)
        certs = {k: os.path.join(d, f'{k}.pem') for k in ('ca', 'cert', 'key')}
        for rnd in range(args.rounds):
            for kx in kxs:
                # The order turns every round, so neither server always goes first.
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for system in order:
                    r = run(system, kx, rnd, args, bin_dir, out_dir, workdir, certs)
                    if r is None:
                        ok = False
                        continue
                    results.setdefault((system, kx), []).append(r)
    text = (f'TLS handshakes (+ one GET each), {args.conns} loops, {args.secs:g} s per run, '
            f'server key {args.key}, generator verify {args.verify}\n\n'
            + table(results, systems, kxs, args.rounds))
    write_table(out_dir, text, args.braid_arg, 'table.md,*.json,*.log')
    sys.exit(0 if ok else 1)


if __name__ == '__main__':
    main()
