//! TLS handshakes per core-second (issue 47): C loops open TLS
//! connections to a running server as fast as they can, each a full
//! handshake (no session resumption), one small GET with
//! `Connection: close`, the answer read to its end (the server closes
//! first, so the TIME_WAIT is on its side), then the next connection.
//!
//! After `--warmup` seconds, it counts the connections completed in
//! `--secs` seconds and the server's CPU in the same window (utime+stime
//! from /proc, summed over `--server-pid` and its descendants: nginx's
//! master and workers), and reports handshakes per server CPU-second and
//! per wall second, its own CPU (so a generator that was the bottleneck
//! shows), the time of a connection and of its handshake, and what the
//! handshakes negotiated (version, cipher suite, key exchange group).
//!
//! The client is rustls with the aws-lc-rs provider (`examples/common/
//! tls.rs`): ALPN `http/1.1`, TLS 1.3 and 1.2 offered; `--kx x25519` (the
//! default) offers X25519 alone, `--kx default` rustls's list
//! (X25519MLKEM768 first, as browsers). `--verify off` skips the
//! certificate's verification (chain and signature), which costs the
//! generator about as much as the server's signing; the server's work is
//! the same either way. Each connection binds one of `--sources` loopback
//! addresses (127.0.0.2, ...) so that the ephemeral ports do not run out.
//!
//! ```sh
//! taskset -c 1 target/release/examples/handshakes --target 127.0.0.1:18443 \
//!     --server-pid PID --tls-ca DIR/ca.pem --conns 32 --secs 10
//! ```
//!
//! `--resume` lets the client resume sessions instead (rustls's in-memory
//! session cache, shared by the loops): the server's tickets are kept and
//! offered, so most connections resume (no certificate, no signature) and
//! the report says how many did. nginx issues tickets by default, and so
//! does braid-proxy.
//!
//! `bench/tls.py` runs it against braid-proxy and nginx, alternately.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

#[path = "common/procs.rs"]
mod procs;
#[path = "common/tls.rs"]
mod tls;

use procs::{percentile, process_tree, usage};

const USAGE: &str = "\
usage: handshakes --target ADDR --server-pid PID [--tls-ca FILE | --verify off]
                  [--conns C] [--secs S] [--warmup S] [--path PATH]
                  [--kx x25519|default] [--resume] [--sources 1..250] [--label NAME]
                  [--json PATH]
See the comment at the top of examples/handshakes.rs.";

struct Args {
    target: SocketAddr,
    server_pid: u32,
    ca: Option<String>,
    verify: tls::Verify,
    kx: tls::Kx,
    resume: bool,
    conns: usize,
    secs: f64,
    warmup: f64,
    path: String,
    sources: u8,
    label: String,
    json: Option<String>,
}

fn args() -> Args {
    let mut target = None;
    let mut server_pid = None;
    let mut a = Args {
        target: "127.0.0.1:0".parse().expect("addr"),
        server_pid: 0,
        ca: None,
        verify: tls::Verify::Full,
        kx: tls::Kx::X25519,
        resume: false,
        conns: 32,
        secs: 10.0,
        warmup: 2.0,
        path: "/".into(),
        sources: 64,
        label: String::new(),
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--resume" {
            a.resume = true;
            continue;
        }
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--target" => target = Some(value.parse().expect("--target 127.0.0.1:PORT")),
            "--server-pid" => server_pid = Some(value.parse().expect("--server-pid PID")),
            "--tls-ca" => a.ca = Some(value),
            "--verify" => {
                a.verify = match value.as_str() {
                    "on" | "full" => tls::Verify::Full,
                    "off" => tls::Verify::Off,
                    other => panic!("--verify on|off, not {other}"),
                }
            }
            "--kx" => a.kx = tls::Kx::parse(&value),
            "--conns" => a.conns = value.parse().expect("--conns C"),
            "--secs" => a.secs = value.parse().expect("--secs S"),
            "--warmup" => a.warmup = value.parse().expect("--warmup S"),
            "--path" => a.path = value,
            "--sources" => a.sources = value.parse().expect("--sources 1..=250"),
            "--label" => a.label = value,
            "--json" => a.json = Some(value),
            other => {
                eprintln!("handshakes: unknown flag {other}\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    a.target = target.unwrap_or_else(|| {
        eprintln!("handshakes: --target is needed\n{USAGE}");
        std::process::exit(2)
    });
    a.server_pid = server_pid.unwrap_or_else(|| {
        eprintln!("handshakes: --server-pid is needed\n{USAGE}");
        std::process::exit(2)
    });
    assert!(
        a.verify == tls::Verify::Off || a.ca.is_some(),
        "--tls-ca FILE (or --verify off)"
    );
    assert!((1..=10_000).contains(&a.conns), "--conns 1..=10000");
    assert!(a.secs > 0.0 && a.secs <= 600.0, "--secs in (0, 600]");
    assert!(a.warmup >= 0.0 && a.warmup <= 60.0, "--warmup in [0, 60]");
    assert!((1..=250).contains(&a.sources), "--sources 1..=250");
    assert!(a.path.starts_with('/'), "--path /...");
    a
}

/// What the loops share.
struct Shared {
    target: SocketAddr,
    connector: tokio_rustls::TlsConnector,
    request: Vec<u8>,
    sources: u8,
    next_source: AtomicU64,
    /// Connections that got a 2xx answer, and those that did not.
    done: AtomicU64,
    /// Connections that resumed a session (`--resume`), in the window.
    resumed: AtomicU64,
    failed: AtomicU64,
    /// Whether latencies are being recorded (the measured window).
    recording: AtomicBool,
    stop: AtomicBool,
    negotiated: OnceLock<String>,
    statuses: Mutex<HashMap<String, u64>>,
    error_said: AtomicBool,
}

impl Shared {
    fn failed(&self, what: &str, e: &dyn std::fmt::Display) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        if !self.error_said.swap(true, Ordering::Relaxed) {
            eprintln!("handshakes: {what}: {e} (later failures only counted)");
        }
    }
}

/// One connection's times (µs): to the end of its handshake, to the end
/// of its answer.
type Times = (u32, u32);

/// One loop: connection after connection until told to stop.
async fn run_loop(shared: Arc<Shared>) -> Vec<Times> {
    let mut times = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !shared.stop.load(Ordering::Relaxed) {
        let i = shared.next_source.fetch_add(1, Ordering::Relaxed);
        let src = SocketAddr::from((
            Ipv4Addr::new(127, 0, 0, 2 + (i % u64::from(shared.sources)) as u8),
            0,
        ));
        let recording = shared.recording.load(Ordering::Relaxed);
        let started = Instant::now();
        let one = async {
            let socket = TcpSocket::new_v4()
                .map_err(|e| shared.failed("socket", &e))
                .ok()?;
            socket
                .bind(src)
                .map_err(|e| shared.failed("bind", &e))
                .ok()?;
            let tcp = socket
                .connect(shared.target)
                .await
                .map_err(|e| shared.failed("connect", &e))
                .ok()?;
            let _ = tcp.set_nodelay(true);
            let mut stream = shared
                .connector
                .connect(tls::server_name(), tcp)
                .await
                .map_err(|e| shared.failed("handshake", &e))
                .ok()?;
            let handshake = started.elapsed();
            if stream.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed)
                && recording
            {
                shared.resumed.fetch_add(1, Ordering::Relaxed);
            }
            if shared.negotiated.get().is_none() {
                let _ = shared.negotiated.set(tls::describe(stream.get_ref().1));
            }
            if let Err(e) = stream.write_all(&shared.request).await {
                shared.failed("write", &e);
                return None;
            }
            let _ = stream.flush().await;
            // The answer to its end: the server closes after it.
            let mut head = Vec::new();
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        if head.len() < 64 {
                            head.extend_from_slice(&buf[..n.min(64)]);
                        }
                    }
                    // A peer that closes without close_notify: the answer
                    // was read already if it came.
                    Err(_) => break,
                }
            }
            Some((handshake, head))
        };
        match tokio::time::timeout(Duration::from_secs(10), one).await {
            Ok(Some((handshake, head))) => {
                let status =
                    String::from_utf8_lossy(head.get(9..12).unwrap_or(b"---")).into_owned();
                if status.starts_with('2') {
                    shared.done.fetch_add(1, Ordering::Relaxed);
                    if recording {
                        let us = |d: Duration| d.as_micros().min(u32::MAX as u128) as u32;
                        times.push((us(handshake), us(started.elapsed())));
                    }
                } else {
                    shared.failed("answer", &format!("status {status}"));
                }
                *shared
                    .statuses
                    .lock()
                    .expect("lock")
                    .entry(status)
                    .or_default() += 1;
            }
            Ok(None) => {}
            Err(_) => shared.failed("connection", &"no answer within 10 s"),
        }
    }
    times
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    let mut config = tls::client_config(a.ca.as_deref().map(std::path::Path::new), a.verify, a.kx);
    if a.resume {
        let mut resuming = (*config).clone();
        resuming.resumption = rustls::client::Resumption::in_memory_sessions(1024);
        config = Arc::new(resuming);
    }
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        a.path
    )
    .into_bytes();
    let shared = Arc::new(Shared {
        target: a.target,
        connector: tokio_rustls::TlsConnector::from(config),
        request,
        sources: a.sources,
        next_source: AtomicU64::new(0),
        done: AtomicU64::new(0),
        resumed: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        recording: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        negotiated: OnceLock::new(),
        statuses: Mutex::new(HashMap::new()),
        error_said: AtomicBool::new(false),
    });
    let pids = process_tree(a.server_pid);
    let me = [std::process::id()];
    let loops: Vec<_> = (0..a.conns)
        .map(|_| tokio::spawn(run_loop(shared.clone())))
        .collect();

    tokio::time::sleep(Duration::from_secs_f64(a.warmup)).await;
    // The window: counters and CPU read back to back at both ends.
    let (done0, failed0) = (
        shared.done.load(Ordering::Relaxed),
        shared.failed.load(Ordering::Relaxed),
    );
    let (server0, own0, t0) = (usage(&pids).cpu, usage(&me).cpu, Instant::now());
    shared.recording.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(a.secs)).await;
    let (done1, failed1) = (
        shared.done.load(Ordering::Relaxed),
        shared.failed.load(Ordering::Relaxed),
    );
    let (server1, own1, wall) = (usage(&pids).cpu, usage(&me).cpu, t0.elapsed().as_secs_f64());
    shared.recording.store(false, Ordering::Relaxed);
    shared.stop.store(true, Ordering::Relaxed);

    let mut handshake = Vec::new();
    let mut total = Vec::new();
    for l in loops {
        if let Ok(Ok(times)) = tokio::time::timeout(Duration::from_secs(15), l).await {
            for (h, t) in times {
                handshake.push(h);
                total.push(t);
            }
        }
    }
    handshake.sort_unstable();
    total.sort_unstable();

    let done = done1 - done0;
    let resumed = shared.resumed.load(Ordering::Relaxed);
    let failed = failed1 - failed0;
    let server_cpu = server1 - server0;
    let own_cpu = own1 - own0;
    let per_cpu = done as f64 / server_cpu.max(0.01);
    let per_wall = done as f64 / wall;
    let negotiated = shared.negotiated.get().cloned().unwrap_or_default();
    let statuses = shared.statuses.lock().expect("lock").clone();
    let label = if a.label.is_empty() {
        a.target.to_string()
    } else {
        a.label.clone()
    };
    println!(
        "{label}: {done} handshakes (+ GET) in {wall:.2} s with {} loops, {failed} failed{}; \
         negotiated {negotiated}",
        a.conns,
        if a.resume {
            format!(", {resumed} resumed")
        } else {
            String::new()
        }
    );
    println!(
        "{per_wall:.0} per wall second; server CPU {server_cpu:.2} s ({:.0}% of one core, {} \
         processes): {per_cpu:.0} handshakes per server CPU-second; this generator's CPU \
         {own_cpu:.2} s ({:.0}% of its core)",
        100.0 * server_cpu / wall,
        pids.len(),
        100.0 * own_cpu / wall
    );
    println!(
        "ms to the handshake's end p50 {:.2} p99 {:.2}; to the answer's end p50 {:.2} p99 {:.2} \
         (statuses {statuses:?})",
        percentile(&handshake, 0.5),
        percentile(&handshake, 0.99),
        percentile(&total, 0.5),
        percentile(&total, 0.99)
    );
    if let Some(path) = &a.json {
        let report = serde_json::json!({
            "label": label,
            "target": a.target.to_string(),
            "path": a.path,
            "conns": a.conns,
            "resume": a.resume,
            "resumed": resumed,
            "verify": format!("{:?}", a.verify).to_lowercase(),
            "kx_offered": format!("{:?}", a.kx).to_lowercase(),
            "negotiated": negotiated,
            "window_secs": wall,
            "handshakes": done,
            "failed": failed,
            "per_wall_sec": per_wall,
            "server_cpu_secs": server_cpu,
            "server_processes": pids.len(),
            "per_server_cpu_sec": per_cpu,
            "generator_cpu_secs": own_cpu,
            "handshake_p50_ms": percentile(&handshake, 0.5),
            "handshake_p99_ms": percentile(&handshake, 0.99),
            "connection_p50_ms": percentile(&total, 0.5),
            "connection_p99_ms": percentile(&total, 0.99),
            "statuses": statuses,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&report).expect("json")).expect("--json");
    }
    if done == 0 {
        eprintln!("handshakes: no connection completed");
        std::process::exit(1);
    }
}
