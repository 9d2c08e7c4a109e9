//! The delivery benchmark's load generator (issue 20): one resource, N
//! subscribers, updates published at R a second, driven the same way
//! against three systems:
//!
//! - `braid`: braid-proxy. The program runs its own origin (`/doc`, ETag
//!   `"g<k>"`), starts the proxy binary in front of it and publishes by
//!   PUT through the proxy (write-through). Each update carries
//!   `Version: "g<k>"`.
//! - `nchan`: nginx + Nchan, already running (`--target`). Subscribers hold
//!   `GET /sub` (an `http-raw-stream` location: one response, messages
//!   separated by a newline); publishing is `POST /pub`.
//! - `pushpin`: Pushpin, already running (`--target`, routed to this
//!   program's origin at `--origin`). The origin answers each subscriber
//!   with `Grip-Hold: stream` + `Grip-Channel: doc`; publishing is
//!   `POST /publish/` on Pushpin's HTTP control port (`--publish`) with an
//!   `http-stream` item.
//! - `floor`: `examples/floor.rs`, already running (`--target`): the least
//!   a server can do per delivery (one write per subscriber, nothing else),
//!   driven as Nchan is.
//!
//! Every update's body is the same for the three: `#k=<k>;` and one letter
//! repeated up to `--payload` bytes, then a newline. A subscriber is a raw
//! socket bound to one of `--sources` loopback addresses (127.0.0.2, ...)
//! before it connects, so 10,000+ connections do not run out of ephemeral
//! ports.
//!
//! Scenarios (`--scenario`):
//! - `idle`: open N subscriptions, compare the server's RSS (all its
//!   processes) before and after.
//! - `fanout`: N subscribers, `--updates` at `--rate`: latency from each
//!   update's *scheduled* publish time to its arrival at each subscriber,
//!   deliveries per server CPU-second, missing and (braid-proxy only)
//!   collapsed updates. Arrival is the kernel's receive stamp of the last
//!   segment a read returned (`SO_TIMESTAMPNS`), so that the time this one
//!   program takes to read 10,000 sockets on its one core is not counted
//!   as the server's; the latency to the program's own read is reported
//!   beside it (`--stamps off` measures to the read only).
//! - `stall`: N subscribers stop reading while `--updates` of `--payload`
//!   bytes are published, then read again: how many stale updates each
//!   reads before the current one.
//!
//! `--edge` measures a second tier: the subscribers and the writes go to a
//! braid-proxy (pinned, measured) whose upstream is another braid-proxy
//! (the shield) in front of the origin, so every update reaches the edge
//! through its upstream subscription.
//!
//! `--h2c-conns C` carries the subscribers as streams over C prior-knowledge
//! h2c connections instead (braid-proxy, or Nchan behind nginx's `http2`
//! listener, with `--publish` naming its HTTP/1.1 one for the POSTs): the
//! arrival is then this generator's read of each DATA frame. With `--tls`
//! the connections are h2 by ALPN over TLS; with C equal to `--subs` each
//! subscriber (the warm-up ones too) is the one stream of its own
//! connection, as a browser tab subscribing over HTTPS is. The connections
//! are made (`--inflight` at a time) before the baseline, so the RSS per
//! subscription is then a stream's, without its connection's.
//!
//! `--tls` makes every subscriber connection a TLS one (rustls with the
//! aws-lc-rs provider, ALPN `http/1.1` only (`h2` only with
//! `--h2c-conns`), no session resumption, the
//! certificate verified against a CA; `examples/common/tls.rs`), then
//! subscribes over it as before. For `--system braid` the program makes a
//! CA and a server certificate for `localhost`/127.0.0.1 in a temporary
//! directory and starts the (measured) proxy with `--tls-cert`/`--tls-key`;
//! its PUTs then go over TLS too, on one keep-alive connection (made
//! before the first update's scheduled time, and again after an error):
//! a handshake per PUT would wait behind a busy proxy's sweeps and make
//! the publisher late. For a running Nchan (`nginx` with an `ssl`
//! listener), `--tls-ca FILE` names the CA to trust and `--publish` its plain
//! listener for the POSTs. `--write-certs DIR` writes `ca.pem`, `cert.pem`
//! and `key.pem` for such a server and exits (`--key ecdsa-p256|rsa2048`,
//! default ECDSA P-256). Over TLS the bytes in the socket are encrypted,
//! so the kernel's receive stamp of a segment says nothing about which
//! update it carries: the latency is taken to this generator's read of the
//! decrypted update (as with `--stamps off`), and so includes the
//! generator's own pace of reading (and decrypting) 10,000 connections.
//! `--kx x25519` (the default) offers X25519 alone, the group nginx with
//! OpenSSL 3.0 picks; `--kx default` offers rustls's list (X25519MLKEM768
//! first).
//!
//! The server's CPU is utime+stime and its RSS VmRSS, summed over the
//! process `--server-pid` (or the braid-proxy this program starts) and all
//! its descendants, from /proc. Loopback only; every wait is bounded.
//!
//! ```sh
//! cargo build --release --examples
//! ulimit -n 20000
//! taskset -c 1 target/release/examples/fanout --proxy target/release/braid-proxy \
//!     --proxy-cpu 0 --subs 10000 --rate 10 --secs 20
//! ```
//!
//! `bench/peers.py` runs the three systems and all scenarios.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, Semaphore};

#[path = "common/procs.rs"]
mod procs;
#[path = "common/tls.rs"]
mod tls;

use procs::{percentile, process_tree, usage};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum System {
    Braid,
    Nchan,
    Pushpin,
    /// `examples/floor.rs`: one write per subscriber and nothing else; it
    /// speaks what Nchan's locations speak.
    Floor,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scenario {
    Idle,
    Fanout,
    Stall,
}

struct Args {
    system: System,
    scenario: Scenario,
    proxy: String,
    proxy_cpu: Option<String>,
    proxy_args: Vec<String>,
    target: Option<SocketAddr>,
    publish: Option<SocketAddr>,
    origin: SocketAddr,
    server_pid: Option<u32>,
    subs: usize,
    rate: f64,
    updates: Option<u64>,
    secs: u64,
    payload: usize,
    sources: u8,
    inflight: usize,
    settle_secs: f64,
    /// Take latencies to the kernel's receive stamp (`--stamps on`, the
    /// default) or only to this generator's read (`--stamps off`).
    stamps: bool,
    /// Carry the subscribers as streams over this many prior-knowledge h2c
    /// connections (`--h2c-conns`; 0, the default: one HTTP/1.1
    /// connection each).
    h2c_conns: usize,
    /// Measure an edge: subscribers and writes go to a braid-proxy whose
    /// upstream is another braid-proxy (the shield, not pinned, not
    /// measured) in front of the origin (`--edge`).
    edge: bool,
    /// Subscribers over TLS (`--tls`).
    tls: bool,
    /// The CA a running server's certificate is verified against
    /// (`--tls-ca`; braid-proxy's is made by this program).
    tls_ca: Option<String>,
    /// Key exchange groups offered over TLS (`--kx`).
    kx: tls::Kx,
    /// The server key `--write-certs` makes (`--key`).
    key: tls::KeyKind,
    json: Option<String>,
}

const USAGE: &str = "\
usage: fanout [--system braid|nchan|pushpin|floor] [--scenario idle|fanout|stall]
              [--subs N] [--rate R] [--updates U | --secs S] [--payload BYTES]
              [--proxy PATH] [--proxy-cpu CPUS] [--proxy-arg ARG]...
              [--target ADDR --server-pid PID] [--publish ADDR] [--origin ADDR]
              [--sources 1..250] [--inflight N] [--settle SECONDS]
              [--stamps on|off] [--h2c-conns C] [--edge] [--json PATH]
              [--tls [--tls-ca FILE] [--kx x25519|default]]
       fanout --write-certs DIR [--key ecdsa-p256|rsa2048]
See the comment at the top of examples/fanout.rs.";

fn args() -> Args {
    let mut a = Args {
        system: System::Braid,
        scenario: Scenario::Fanout,
        proxy: "target/release/braid-proxy".into(),
        proxy_cpu: None,
        proxy_args: Vec::new(),
        target: None,
        publish: None,
        origin: "127.0.0.1:0".parse().expect("addr"),
        server_pid: None,
        subs: 1000,
        rate: 10.0,
        updates: None,
        secs: 10,
        payload: 100,
        sources: 64,
        inflight: 64,
        settle_secs: 1.0,
        stamps: true,
        h2c_conns: 0,
        edge: false,
        tls: false,
        tls_ca: None,
        kx: tls::Kx::X25519,
        key: tls::KeyKind::EcdsaP256,
        json: None,
    };
    let mut write_certs = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--edge" {
            a.edge = true;
            continue;
        }
        if flag == "--tls" {
            a.tls = true;
            continue;
        }
        let value = it.next().unwrap_or_default();
        let addr = |v: &str| {
            v.parse::<SocketAddr>()
                .expect("an address such as 127.0.0.1:80")
        };
        match flag.as_str() {
            "--system" => {
                a.system = match value.as_str() {
                    "braid" | "braid-proxy" => System::Braid,
                    "nchan" => System::Nchan,
                    "floor" => System::Floor,
                    "pushpin" => System::Pushpin,
                    other => panic!("--system braid|nchan|pushpin|floor, not {other}"),
                }
            }
            "--scenario" => {
                a.scenario = match value.as_str() {
                    "idle" => Scenario::Idle,
                    "fanout" => Scenario::Fanout,
                    "stall" => Scenario::Stall,
                    other => panic!("--scenario idle|fanout|stall, not {other}"),
                }
            }
            "--proxy" => a.proxy = value,
            "--proxy-cpu" => a.proxy_cpu = Some(value),
            "--proxy-arg" => a.proxy_args.push(value),
            "--target" => a.target = Some(addr(&value)),
            "--publish" => a.publish = Some(addr(&value)),
            "--origin" => a.origin = addr(&value),
            "--server-pid" => a.server_pid = Some(value.parse().expect("--server-pid PID")),
            "--subs" => a.subs = value.parse().expect("--subs N"),
            "--rate" => a.rate = value.parse().expect("--rate R"),
            "--updates" => a.updates = Some(value.parse().expect("--updates U")),
            "--secs" => a.secs = value.parse().expect("--secs S"),
            "--payload" | "--doc-bytes" => a.payload = value.parse().expect("--payload BYTES"),
            "--sources" => a.sources = value.parse().expect("--sources 1..=250"),
            "--inflight" => a.inflight = value.parse().expect("--inflight N"),
            "--settle" => a.settle_secs = value.parse().expect("--settle SECONDS"),
            "--stamps" => {
                a.stamps = match value.as_str() {
                    "on" => true,
                    "off" => false,
                    other => panic!("--stamps on|off, not {other}"),
                }
            }
            "--h2c-conns" => a.h2c_conns = value.parse().expect("--h2c-conns C"),
            "--tls-ca" => a.tls_ca = Some(value),
            "--kx" => a.kx = tls::Kx::parse(&value),
            "--key" => a.key = tls::KeyKind::parse(&value),
            "--write-certs" => write_certs = Some(value),
            "--json" => a.json = Some(value),
            other => {
                eprintln!("fanout: unknown flag {other}\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    if let Some(dir) = write_certs {
        let files = tls::write_certs(std::path::Path::new(&dir), a.key);
        println!(
            "wrote {}, {} and {} ({:?}, for localhost and 127.0.0.1)",
            files.ca.display(),
            files.cert.display(),
            files.key.display(),
            a.key
        );
        std::process::exit(0);
    }
    let updates = a.updates.unwrap_or((a.rate * a.secs as f64) as u64);
    assert!(
        a.rate > 0.0 && updates > 0 && updates as f64 / a.rate <= 600.0,
        "rate > 0, at least one update, at most 600 s of publishing"
    );
    assert!(a.subs <= 100_000, "--subs at most 100000");
    assert!((1..=250).contains(&a.sources), "--sources 1..=250");
    assert!((1..=10_000).contains(&a.inflight), "--inflight 1..=10000");
    assert!(
        a.payload >= 16 && a.payload <= 1 << 20,
        "--payload 16..=1MiB"
    );
    if a.system != System::Braid {
        assert!(
            a.target.is_some() && a.server_pid.is_some(),
            "--target and --server-pid are needed for nchan and pushpin"
        );
    }
    if a.system == System::Pushpin {
        assert!(
            a.publish.is_some(),
            "--publish (Pushpin's HTTP control port)"
        );
    }
    if a.h2c_conns > 0 {
        assert!(
            matches!(a.system, System::Braid | System::Nchan),
            "--h2c-conns: braid-proxy and Nchan (nginx's http2 listener) speak h2c"
        );
        assert!(a.h2c_conns <= a.subs.max(1), "--h2c-conns at most --subs");
    }
    if a.tls {
        assert!(
            matches!(a.system, System::Braid | System::Nchan),
            "--tls: braid-proxy and Nchan (nginx's ssl listener)"
        );
        if a.system != System::Braid {
            assert!(
                a.tls_ca.is_some(),
                "--tls against a running server needs --tls-ca (the CA of its certificate)"
            );
            assert!(
                a.publish.is_some(),
                "--tls against a running server needs --publish (its plain listener for the POSTs)"
            );
        }
    }
    a.updates = Some(updates);
    a
}

/// The body of update k, the same for every system: `#k=<k>;`, one letter
/// repeated (a different letter each version, so no system can send less
/// than the whole), a newline; `bytes` long in all.
fn payload(k: u64, bytes: usize) -> Vec<u8> {
    let mut body = format!("#k={k};").into_bytes();
    let letter = b'a' + (k % 26) as u8;
    body.resize(bytes.saturating_sub(1).max(body.len()), letter);
    body.push(b'\n');
    body
}

/// The origin's one document (braid-proxy's upstream): its version number.
struct Doc {
    k: u64,
    bytes: usize,
}

/// Starts the origin on a thread of its own (its own event loop, on the
/// generator's core): a real origin is another server, so its answers must
/// not wait behind the generator's reading of thousands of sockets, which
/// would add to braid-proxy's latency alone (its publish path asks the
/// origin twice; the peers are published to directly).
fn origin(listen: SocketAddr, doc: Arc<Mutex<Doc>>, grip: bool) -> SocketAddr {
    let listener = std::net::TcpListener::bind(listen).expect("bind origin");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("origin runtime");
    std::thread::spawn(move || runtime.block_on(serve_origin(listener, doc, grip)));
    addr
}

async fn serve_origin(listener: std::net::TcpListener, doc: Arc<Mutex<Doc>>, grip: bool) {
    let listener = TcpListener::from_std(listener).expect("origin listener");
    while let Ok((stream, _)) = listener.accept().await {
        let doc = doc.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let doc = doc.clone();
                async move {
                    Ok::<_, Infallible>(if grip {
                        grip_answer()
                    } else {
                        answer(&doc, &req)
                    })
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Pushpin's upstream: hold every request as a stream on channel `doc`.
/// `Connection: close` so that the proxy's connections to this process do
/// not pile up next to the subscribers'.
fn grip_answer() -> Response<Full<Bytes>> {
    Response::builder()
        .header("content-type", "text/plain")
        .header("grip-hold", "stream")
        .header("grip-channel", "doc")
        .header("connection", "close")
        .body(Full::new(Bytes::from_static(b"ready\n")))
        .expect("response")
}

fn answer(doc: &Mutex<Doc>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let mut doc = doc.lock().expect("lock");
    if req.method() == http::Method::PUT {
        doc.k += 1;
        return Response::builder()
            .status(204)
            .body(Full::new(Bytes::new()))
            .expect("response");
    }
    let etag = format!("\"g{}\"", doc.k);
    let same = req
        .headers()
        .get("if-none-match")
        .is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let builder = Response::builder()
        .header("etag", &etag)
        .header("content-type", "application/octet-stream");
    if same {
        return builder
            .status(304)
            .body(Full::new(Bytes::new()))
            .expect("response");
    }
    builder
        .body(Full::new(Bytes::from(payload(doc.k, doc.bytes))))
        .expect("response")
}

/// Starts braid-proxy; returns its address and process.
async fn start_proxy(
    a: &Args,
    upstream: SocketAddr,
    pinned: bool,
    certs: Option<&tls::CertFiles>,
) -> (SocketAddr, tokio::process::Child) {
    let mut cmd = match a.proxy_cpu.as_ref().filter(|_| pinned) {
        Some(cpu) => {
            let mut c = tokio::process::Command::new("taskset");
            c.args(["-c", cpu, &a.proxy]);
            c
        }
        None => tokio::process::Command::new(&a.proxy),
    };
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &format!("http://{upstream}"),
        "--poll-interval",
        "30s",
        "--heartbeat",
        "0",
        "--max-subscriptions",
        "1000000",
        "--max-subscriptions-per-resource",
        "1000000",
    ])
    .args(certs.map_or(Vec::new(), |c| {
        vec![
            "--tls-cert".into(),
            c.cert.display().to_string(),
            "--tls-key".into(),
            c.key.display().to_string(),
        ]
    }))
    .args(&a.proxy_args)
    .env("RUST_LOG", "warn")
    .stdout(std::process::Stdio::piped())
    .kill_on_drop(true);
    let mut child = cmd.spawn().expect("start the proxy");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(deadline.into(), lines.next_line()).await
    {
        let rest = line
            .strip_prefix("braid-proxy listening on http://")
            .or_else(|| line.strip_prefix("braid-proxy listening on https://"));
        if let Some(rest) = rest {
            let addr = rest.trim().parse().expect("proxy address");
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            return (addr, child);
        }
    }
    panic!("the proxy exited (or said nothing for 30 s) before listening");
}

/// When update k was scheduled to be published.
struct Schedule {
    start: Instant,
    period: Duration,
    first_k: u64,
    last_k: u64,
    /// CLOCK_REALTIME at `start`, to place the kernel's receive stamps
    /// (which are in that clock) on the `Instant` line.
    start_realtime: Duration,
}

impl Schedule {
    /// None for a k outside the run (so a bad k read off the wire cannot
    /// grow a subscriber's `Seen`).
    fn scheduled(&self, k: u64) -> Option<Instant> {
        if k > self.last_k {
            return None;
        }
        let i = k.checked_sub(self.first_k)?;
        Some(self.start + self.period.mul_f64(i as f64))
    }

    /// The `Instant` of a CLOCK_REALTIME reading (a kernel receive stamp).
    fn instant_of(&self, realtime: Duration) -> Instant {
        match realtime.checked_sub(self.start_realtime) {
            Some(after) => self.start + after,
            None => self
                .start
                .checked_sub(self.start_realtime - realtime)
                .unwrap_or(self.start),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Control {
    Read,
    Pause,
    Stop,
}

/// What the subscribers share.
struct Shared {
    system: System,
    target: SocketAddr,
    path: &'static str,
    ready: AtomicU64,
    /// Subscriptions that failed (no connection, or not a 2xx answer).
    refused: AtomicU64,
    /// The last update's k once known (0 before); subscribers count
    /// themselves in `got_last` when they see it.
    last_k: AtomicU64,
    got_last: AtomicU64,
    schedule: tokio::sync::OnceCell<Schedule>,
    connect_slots: Semaphore,
    /// Whether sockets ask for kernel receive stamps.
    stamps: bool,
    /// `--tls`: the connector every subscriber's handshake uses.
    tls: Option<tokio_rustls::TlsConnector>,
    /// What the first TLS handshake negotiated (version, suite, group, ALPN).
    negotiated: std::sync::OnceLock<String>,
    /// The first TLS failure was reported (the others are only counted).
    tls_error_said: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// The subscription request, the same over TCP and TLS.
    fn request(&self) -> String {
        // FANOUT_HYPER_PATH=1 adds a Connection option, which keeps a
        // braid-proxy subscription off its fast path (src/net/fastpath.rs): an A/B
        // of the proxy's two HTTP/1.1 paths in one binary.
        let hyper_path = if std::env::var_os("FANOUT_HYPER_PATH").is_some() {
            "Connection: keep-alive, x-bench\r\n"
        } else {
            ""
        };
        match self.system {
            System::Braid => format!(
                "GET {} HTTP/1.1\r\nHost: bench\r\nSubscribe: true\r\n{hyper_path}\r\n",
                self.path
            ),
            _ => format!("GET {} HTTP/1.1\r\nHost: bench\r\n\r\n", self.path),
        }
    }

    /// Says the first TLS failure on stderr.
    fn tls_failed(&self, what: &str, e: &dyn std::fmt::Display) {
        if !self.tls_error_said.swap(true, Ordering::Relaxed) {
            eprintln!("TLS subscriber: {what}: {e} (later failures only counted)");
        }
    }
}

#[derive(Default)]
struct SubResult {
    ready: bool,
    /// Every update read: (k, latency in µs from its scheduled time to its
    /// arrival in the socket, the same to the read).
    got: Vec<(u64, u32, u32)>,
    /// Reads that came without a kernel receive stamp (their arrival is
    /// taken as the read).
    unstamped: u64,
    /// Bytes read after the last `Pause` ended.
    bytes_after_resume: u64,
}

/// The source address of subscriber i: 127.0.0.2, 127.0.0.3, ...
fn source(i: usize, sources: u8) -> SocketAddr {
    let x = 2 + (i % sources as usize) as u8;
    SocketAddr::from((Ipv4Addr::new(127, 0, 0, x), 0))
}

async fn connect_from(src: SocketAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(src)?;
    socket.connect(target).await
}

/// One subscriber: subscribes, then records every update it reads.
async fn subscriber(
    shared: Arc<Shared>,
    src: SocketAddr,
    mut control: watch::Receiver<Control>,
) -> SubResult {
    let mut result = SubResult::default();
    // A slot is held from the connect until the response head arrives, so
    // that at most `--inflight` subscriptions are being set up at once.
    let Ok(permit) = shared.connect_slots.acquire().await else {
        return result;
    };
    let connect = connect_from(src, shared.target);
    let mut stream = match tokio::time::timeout(Duration::from_secs(30), connect).await {
        Ok(Ok(s)) => s,
        _ => {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            return result;
        }
    };
    let request = shared.request();
    // The kernel stamps each segment as it reaches the socket; the latency
    // is taken to that arrival, so that this generator's own pace of
    // reading 10,000 sockets on one core does not count as the server's.
    let stamps = nix::sys::socket::setsockopt(
        &stream,
        nix::sys::socket::sockopt::ReceiveTimestampns,
        &shared.stamps,
    );
    if stamps.is_err() || stream.write_all(request.as_bytes()).await.is_err() {
        shared.refused.fetch_add(1, Ordering::Relaxed);
        return result;
    }
    // `with_interest` is deprecated because a `T` may hand out an fd it does
    // not own; a std `TcpStream` owns its fd and `AsyncFd` owns the stream,
    // so the registration cannot outlive the fd here.
    #[allow(deprecated)]
    let stream = match stream
        .into_std()
        .and_then(|s| AsyncFd::with_interest(s, Interest::READABLE))
    {
        Ok(fd) => fd,
        Err(_) => {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            return result;
        }
    };
    let mut cmsg = nix::cmsg_space!(nix::sys::time::TimeSpec);

    let mut buf = vec![0u8; 64 * 1024];
    let mut reading = Reading::new(Some(permit));
    let mut was_paused = false;
    'control: loop {
        if !until_reading(&mut control, &mut was_paused).await {
            return result;
        }
        // One wait for a control change for the whole run of reads (not one
        // per read: each would register with, and leave, the watch's waiter
        // list, which all 10,000 subscribers share).
        let changed = control.changed();
        tokio::pin!(changed);
        loop {
            let (n, stamp) = tokio::select! {
                biased;
                changed = &mut changed => match changed {
                    Ok(()) => continue 'control,
                    Err(_) => return result,
                },
                read = read_stamped(&stream, &mut buf, &mut cmsg) => match read {
                    Ok((n, stamp)) if n > 0 => (n, stamp),
                    _ => {
                        if !reading.head_done {
                            shared.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        return result;
                    }
                },
            };
            let now = Instant::now();
            if !reading.took(&shared, &buf[..n], stamp, now, was_paused, &mut result) {
                return result;
            }
        }
    }
}

/// What one subscriber has read so far: the bytes not yet scanned, whether
/// the response head came, the versions seen, and its set-up slot until
/// the head came.
struct Reading<'a> {
    carry: Vec<u8>,
    head_done: bool,
    seen: Seen,
    slot: Option<tokio::sync::SemaphorePermit<'a>>,
}

impl<'a> Reading<'a> {
    fn new(slot: Option<tokio::sync::SemaphorePermit<'a>>) -> Self {
        Reading {
            carry: Vec::new(),
            head_done: false,
            seen: Seen::default(),
            slot,
        }
    }

    /// Takes what one read returned (at `now`, with the kernel's stamp
    /// when there is one): the response head first (its set-up slot freed
    /// and the subscriber counted ready once it is a 2xx), then every
    /// update in it. False when the subscription was refused (counted).
    fn took(
        &mut self,
        shared: &Shared,
        data: &[u8],
        stamp: Option<Duration>,
        now: Instant,
        was_paused: bool,
        result: &mut SubResult,
    ) -> bool {
        if stamp.is_none() {
            result.unstamped += 1;
        }
        if was_paused {
            result.bytes_after_resume += data.len() as u64;
        }
        self.carry.extend_from_slice(data);
        let mut pos = 0;
        if !self.head_done {
            let Some(i) = find(&self.carry, b"\r\n\r\n") else {
                if self.carry.len() > 64 * 1024 {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                return true;
            };
            // "HTTP/1.1 2xx": 200 for the peers, 209 for braid-proxy.
            if self.carry.get(9) != Some(&b'2') {
                let status = self.carry.split(|&b| b == b'\r').next().unwrap_or_default();
                eprintln!(
                    "subscription refused: {}",
                    String::from_utf8_lossy(&status[..status.len().min(100)])
                );
                shared.refused.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            self.head_done = true;
            drop(self.slot.take());
            result.ready = true;
            shared.ready.fetch_add(1, Ordering::Relaxed);
            pos = i + 4;
        }
        scan(
            shared,
            &mut self.carry,
            pos,
            &mut self.seen,
            result,
            stamp,
            now,
        );
        true
    }
}

/// One subscriber over TLS (`--tls`): the handshake, then the same request
/// and the same record as [`subscriber`]'s, read from the TLS stream. The
/// arrival is this generator's read of the decrypted bytes: the kernel's
/// stamp of an encrypted segment cannot be tied to an update.
async fn tls_subscriber(
    shared: Arc<Shared>,
    src: SocketAddr,
    mut control: watch::Receiver<Control>,
) -> SubResult {
    let mut result = SubResult::default();
    let Ok(permit) = shared.connect_slots.acquire().await else {
        return result;
    };
    let connector = shared.tls.clone().expect("--tls");
    let request = shared.request();
    let go = async {
        let tcp = connect_from(src, shared.target)
            .await
            .map_err(|e| shared.tls_failed("connect", &e))
            .ok()?;
        let mut stream = connector
            .connect(tls::server_name(), tcp)
            .await
            .map_err(|e| shared.tls_failed("handshake", &e))
            .ok()?;
        stream.write_all(request.as_bytes()).await.ok()?;
        stream.flush().await.ok()?;
        Some(stream)
    };
    let mut stream = match tokio::time::timeout(Duration::from_secs(30), go).await {
        Ok(Some(s)) => s,
        _ => {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            return result;
        }
    };
    if shared.negotiated.get().is_none() {
        let _ = shared.negotiated.set(tls::describe(stream.get_ref().1));
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut reading = Reading::new(Some(permit));
    let mut was_paused = false;
    'control: loop {
        if !until_reading(&mut control, &mut was_paused).await {
            return result;
        }
        let changed = control.changed();
        tokio::pin!(changed);
        loop {
            // tokio-rustls's read is cancel safe: what it decrypted and did
            // not return stays in the session for the next read.
            let n = tokio::select! {
                biased;
                changed = &mut changed => match changed {
                    Ok(()) => continue 'control,
                    Err(_) => return result,
                },
                read = stream.read(&mut buf) => match read {
                    Ok(n) if n > 0 => n,
                    other => {
                        if !reading.head_done {
                            if let Err(e) = other {
                                shared.tls_failed("read", &e);
                            }
                            shared.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        return result;
                    }
                },
            };
            let now = Instant::now();
            if !reading.took(&shared, &buf[..n], None, now, was_paused, &mut result) {
                return result;
            }
        }
    }
}

/// Waits while the run is paused (noting that it was); false once it is
/// over.
async fn until_reading(control: &mut watch::Receiver<Control>, was_paused: &mut bool) -> bool {
    loop {
        let state = *control.borrow_and_update();
        match state {
            Control::Stop => return false,
            Control::Read => return true,
            Control::Pause => {
                *was_paused = true;
                if control.changed().await.is_err() {
                    return false;
                }
            }
        }
    }
}

/// Reads the update markers in `carry` from `pos` on, records each update
/// not seen before (its latency to `stamp`, the kernel's arrival stamp, or
/// to `now` without one, and to `now`), and drops what has been read but
/// the tail that may hold the start of a marker split across reads.
fn scan(
    shared: &Shared,
    carry: &mut Vec<u8>,
    mut pos: usize,
    seen: &mut Seen,
    result: &mut SubResult,
    stamp: Option<Duration>,
    now: Instant,
) {
    let (needle, end_byte) = marker(shared.system);
    let mut keep_from = None;
    while let Some(i) = find(&carry[pos..], needle) {
        let start = pos + i + needle.len();
        let Some(end) = carry[start..].iter().position(|&b| b == end_byte) else {
            keep_from = Some(pos + i);
            break;
        };
        let k: u64 = std::str::from_utf8(&carry[start..start + end])
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        pos = start + end;
        let Some(schedule) = shared.schedule.get() else {
            continue;
        };
        if let Some(at) = schedule.scheduled(k) {
            if seen.insert(k) {
                let arrived = stamp.map_or(now, |t| schedule.instant_of(t).min(now));
                let micros = |t: Instant| {
                    let us = t.saturating_duration_since(at).as_micros();
                    us.min(u32::MAX as u128) as u32
                };
                result.got.push((k, micros(arrived), micros(now)));
                if k == shared.last_k.load(Ordering::Relaxed) {
                    shared.got_last.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    let keep_from =
        keep_from.unwrap_or_else(|| carry.len().saturating_sub(needle.len() + 24).max(pos));
    carry.drain(..keep_from.min(carry.len()));
}

/// How an update is told apart in a system's stream: braid-proxy's by its
/// Version header, the others' by the marker at the start of the payload.
fn marker(system: System) -> (&'static [u8], u8) {
    match system {
        System::Braid => (b"Version: \"g", b'"'),
        _ => (b"#k=", b';'),
    }
}

/// One HTTP/2 connection from `src` (its connection task spawned), for
/// `--h2c-conns`: the subscribers share these as streams. Prior-knowledge
/// h2c, or h2 by ALPN over TLS when `tls` is given (`--tls`); then the
/// session's parameters are recorded once in `negotiated`.
async fn h2_connect(
    src: SocketAddr,
    target: SocketAddr,
    tls: Option<&tokio_rustls::TlsConnector>,
    negotiated: &std::sync::OnceLock<String>,
) -> Option<H2Send> {
    let go = async {
        let tcp = connect_from(src, target).await.ok()?;
        let builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        let Some(connector) = tls else {
            let (send, conn) = builder.handshake(TokioIo::new(tcp)).await.ok()?;
            tokio::spawn(conn);
            return Some(send);
        };
        let stream = connector.connect(tls::server_name(), tcp).await.ok()?;
        let session = stream.get_ref().1;
        if session.alpn_protocol() != Some(b"h2") {
            eprintln!("--tls --h2c-conns: the server did not choose h2 by ALPN");
            return None;
        }
        let _ = negotiated.set(tls::describe(session));
        let (send, conn) = builder.handshake(TokioIo::new(stream)).await.ok()?;
        tokio::spawn(conn);
        Some(send)
    };
    tokio::time::timeout(Duration::from_secs(30), go)
        .await
        .ok()
        .flatten()
}

type H2Send = hyper::client::conn::http2::SendRequest<Empty<Bytes>>;

/// The TLS connector of `--tls --h2c-conns`: `tls`'s configuration
/// offering only `h2` by ALPN.
fn h2_connector(tls: &tokio_rustls::TlsConnector) -> tokio_rustls::TlsConnector {
    let mut config = (**tls.config()).clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One subscriber carried as a stream of a shared h2c connection: the same
/// request and the same record as [`subscriber`]'s, but the arrival is this
/// generator's read of the DATA frame (hyper decodes the frames, so there
/// is no kernel stamp per stream).
async fn h2c_subscriber(
    shared: Arc<Shared>,
    mut send: H2Send,
    mut control: watch::Receiver<Control>,
) -> SubResult {
    let mut result = SubResult::default();
    let Ok(permit) = shared.connect_slots.acquire().await else {
        return result;
    };
    // Over TLS the authority is the name the handshake sent (SNI), as a
    // browser's: nginx leaves a stream whose :authority differs unanswered.
    let (scheme, authority) = if shared.tls.is_some() {
        ("https", "localhost")
    } else {
        ("http", "bench")
    };
    let mut request = Request::get(format!("{scheme}://{authority}{}", shared.path));
    if shared.system == System::Braid {
        request = request.header("subscribe", "true");
    }
    let request = request.body(Empty::new()).expect("request");
    let answer = async {
        send.ready().await.ok()?;
        send.send_request(request).await.ok()
    };
    let response = match tokio::time::timeout(Duration::from_secs(30), answer).await {
        Ok(Some(r)) if r.status().is_success() => r,
        other => {
            if let Ok(Some(r)) = other {
                eprintln!("subscription refused: {}", r.status());
            }
            shared.refused.fetch_add(1, Ordering::Relaxed);
            return result;
        }
    };
    drop(permit);
    result.ready = true;
    shared.ready.fetch_add(1, Ordering::Relaxed);
    let mut body = response.into_body();
    let mut carry: Vec<u8> = Vec::new();
    let mut seen = Seen::default();
    let mut was_paused = false;
    'control: loop {
        if !until_reading(&mut control, &mut was_paused).await {
            return result;
        }
        let changed = control.changed();
        tokio::pin!(changed);
        loop {
            let frame = tokio::select! {
                biased;
                changed = &mut changed => match changed {
                    Ok(()) => continue 'control,
                    Err(_) => return result,
                },
                frame = body.frame() => frame,
            };
            let data = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
                _ => return result,
            };
            let now = Instant::now();
            result.unstamped += 1;
            if was_paused {
                result.bytes_after_resume += data.len() as u64;
            }
            carry.extend_from_slice(&data);
            scan(&shared, &mut carry, 0, &mut seen, &mut result, None, now);
        }
    }
}

/// CLOCK_REALTIME now, as time since the epoch.
fn realtime_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Reads what has arrived on `fd`, with the kernel's receive stamp of the
/// last segment read (`SO_TIMESTAMPNS`: CLOCK_REALTIME since the epoch).
async fn read_stamped(
    fd: &AsyncFd<std::net::TcpStream>,
    buf: &mut [u8],
    cmsg: &mut [u8],
) -> std::io::Result<(usize, Option<Duration>)> {
    let len = buf.len();
    loop {
        let mut guard = fd.readable().await?;
        let read = guard.try_io(|s| {
            let mut iov = [std::io::IoSliceMut::new(&mut *buf)];
            let msg = nix::sys::socket::recvmsg::<()>(
                s.get_ref().as_raw_fd(),
                &mut iov,
                Some(&mut *cmsg),
                nix::sys::socket::MsgFlags::empty(),
            )?;
            let mut stamp = None;
            for c in msg.cmsgs()? {
                if let nix::sys::socket::ControlMessageOwned::ScmTimestampns(ts) = c {
                    stamp = Some(Duration::new(ts.tv_sec() as u64, ts.tv_nsec() as u32));
                }
            }
            Ok((msg.bytes, stamp))
        });
        match read {
            Ok(Ok((n, stamp))) => {
                // A short read emptied the socket: wait for the next edge
                // rather than asking again only to hear EAGAIN.
                if n > 0 && n < len {
                    guard.clear_ready();
                }
                return Ok((n, stamp));
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

/// The versions one subscriber has read: a bit per k.
#[derive(Default)]
struct Seen(Vec<u64>);

impl Seen {
    /// Records k; false if it was recorded already.
    fn insert(&mut self, k: u64) -> bool {
        let (word, bit) = ((k / 64) as usize, 1u64 << (k % 64));
        if word >= self.0.len() {
            self.0.resize(word + 1, 0);
        }
        let fresh = self.0[word] & bit == 0;
        self.0[word] |= bit;
        fresh
    }
}

/// The first place `needle` (not empty) starts in `haystack`: a scan for its
/// first byte, then a compare, which is much cheaper than comparing every
/// window when, as here, the first byte is rare.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, rest) = needle.split_first()?;
    let mut from = 0;
    while let Some(i) = haystack[from..].iter().position(|&b| b == first) {
        let at = from + i;
        if haystack[at + 1..].starts_with(rest) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// One HTTP request on a fresh connection; true on a 2xx answer.
async fn request(addr: SocketAddr, head: &str, body: &[u8]) -> bool {
    let go = async {
        let s = TcpStream::connect(addr).await.ok()?;
        Some(exchange(s, head, body).await)
    };
    tokio::time::timeout(Duration::from_secs(10), go)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// The publisher's keep-alive HTTP/1.1 connection to braid-proxy's TLS
/// listener (`--tls`).
type PublishTls = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// Opens the publisher's connection: a TLS handshake, then HTTP/1.1 by
/// hyper (its connection task spawned).
async fn tls_publisher(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
) -> Option<PublishTls> {
    let go = async {
        let tcp = TcpStream::connect(addr).await.ok()?;
        let _ = tcp.set_nodelay(true);
        let tls = connector.connect(tls::server_name(), tcp).await.ok()?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .ok()?;
        tokio::spawn(conn);
        Some(send)
    };
    tokio::time::timeout(Duration::from_secs(10), go)
        .await
        .ok()
        .flatten()
}

/// One PUT on the publisher's connection; true on a 2xx. The connection
/// is dropped (made again before the next update) after an error.
async fn put_over(conn: &mut Option<PublishTls>) -> bool {
    let Some(send) = conn.as_mut() else {
        return false;
    };
    let go = async {
        send.ready().await.ok()?;
        let request = Request::put("/doc")
            .header("host", "bench")
            .body(Full::new(Bytes::from_static(b"x")))
            .expect("request");
        let response = send.send_request(request).await.ok()?;
        let ok = response.status().is_success();
        response.into_body().collect().await.ok()?;
        Some(ok)
    };
    match tokio::time::timeout(Duration::from_secs(10), go).await {
        Ok(Some(ok)) => ok,
        _ => {
            *conn = None;
            false
        }
    }
}

/// Sends one request (`Connection: close`) on `s` and reads the answer to
/// its end; true on a 2xx. An error after the status line (a reset) does
/// not undo the status read.
async fn exchange<S>(mut s: S, head: &str, body: &[u8]) -> bool
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut req = format!(
        "{head}Host: bench\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    if s.write_all(&req).await.is_err() || s.flush().await.is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    answer.get(9) == Some(&b'2')
}

/// Publishes update k (braid-proxy: the origin numbers it). `tls`: the
/// publisher's connection to braid-proxy's TLS listener (`--tls`).
async fn publish(
    a: &Args,
    server: SocketAddr,
    k: u64,
    tls: Option<&mut Option<PublishTls>>,
) -> bool {
    match a.system {
        System::Braid => match tls {
            Some(conn) => put_over(conn).await,
            None => request(server, "PUT /doc HTTP/1.1\r\n", b"x").await,
        },
        System::Nchan | System::Floor => {
            // An h2c-only listener takes no HTTP/1.1 POST: `--publish`
            // names the server's HTTP/1.1 one then.
            let to = a.publish.unwrap_or(server);
            request(to, "POST /pub HTTP/1.1\r\n", &payload(k, a.payload)).await
        }
        System::Pushpin => {
            let content = String::from_utf8(payload(k, a.payload)).expect("ascii");
            let item = serde_json::json!({
                "items": [{"channel": "doc", "formats": {"http-stream": {"content": content}}}]
            });
            let body = serde_json::to_vec(&item).expect("json");
            let publish = a.publish.expect("--publish");
            request(
                publish,
                "POST /publish/ HTTP/1.1\r\nContent-Type: application/json\r\n",
                &body,
            )
            .await
        }
    }
}

/// The largest of the sorted latencies (µs), in ms.
fn max_ms(sorted: &[u32]) -> f64 {
    sorted.last().map_or(f64::NAN, |m| f64::from(*m) / 1000.0)
}

/// Waits until `at`, to within a few µs. tokio's timer has a granularity
/// of 1 ms and wakes after the deadline (about 1.4 ms late at the median
/// here), which would count as every system's latency: it sleeps to 2 ms
/// before, then yields to the subscribers' reads until `at`.
async fn punctual(at: Instant) {
    if let Some(early) = at.checked_sub(Duration::from_millis(2)) {
        tokio::time::sleep_until(early.into()).await;
    }
    while Instant::now() < at {
        tokio::task::yield_now().await;
    }
}

/// Waits until `done()` or the deadline; bounded.
async fn wait_until(deadline: Instant, done: impl Fn() -> bool) {
    while !done() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn name(s: System) -> &'static str {
    match s {
        System::Braid => "braid-proxy",
        System::Nchan => "nchan",
        System::Pushpin => "pushpin",
        System::Floor => "floor",
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    let updates = a.updates.expect("set by args()");
    let doc = Arc::new(Mutex::new(Doc {
        k: 0,
        bytes: a.payload,
    }));
    let upstream = origin(a.origin, doc.clone(), a.system == System::Pushpin);
    // --tls: braid-proxy's certificate made here (removed at the end), a
    // running server's CA given.
    let certs_dir = (a.tls && a.system == System::Braid)
        .then(|| std::env::temp_dir().join(format!("fanout-tls-{}", std::process::id())));
    let certs = certs_dir
        .as_ref()
        .map(|dir| tls::write_certs(dir, tls::KeyKind::EcdsaP256));
    let connector = a.tls.then(|| {
        let ca = certs
            .as_ref()
            .map(|c| c.ca.clone())
            .or_else(|| a.tls_ca.as_ref().map(std::path::PathBuf::from));
        tokio_rustls::TlsConnector::from(tls::client_config(ca.as_deref(), tls::Verify::Full, a.kx))
    });
    let mut child = None;
    // Lives as long as the run: dropped, it kills the shield.
    let mut _shield = None;
    let (target, root) = match a.system {
        System::Braid => {
            let upstream = if a.edge {
                let (addr, c) = start_proxy(&a, upstream, false, None).await;
                _shield = Some(c);
                addr
            } else {
                upstream
            };
            let (addr, c) = start_proxy(&a, upstream, true, certs.as_ref()).await;
            // `taskset` execs the proxy, so this is the proxy's pid either way.
            let pid = c.id().expect("proxy pid");
            child = Some(c);
            (addr, pid)
        }
        _ => (
            a.target.expect("--target"),
            a.server_pid.expect("--server-pid"),
        ),
    };
    let pids = process_tree(root);
    let path = match a.system {
        System::Nchan | System::Floor => "/sub",
        _ => "/doc",
    };
    let shared = Arc::new(Shared {
        system: a.system,
        target,
        path,
        ready: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        last_k: AtomicU64::new(0),
        got_last: AtomicU64::new(0),
        schedule: tokio::sync::OnceCell::new(),
        connect_slots: Semaphore::new(a.inflight),
        stamps: a.stamps && !a.tls,
        tls: connector.clone(),
        negotiated: std::sync::OnceLock::new(),
        tls_error_said: std::sync::atomic::AtomicBool::new(false),
    });
    let (control, controlled) = watch::channel(Control::Read);
    // Subscribers made before the baseline (below).
    const WARM: usize = 10;
    // The HTTP/2 connections, --inflight at a time (over TLS each is a
    // handshake), before the baseline: with them, the RSS per subscription
    // is a stream's, without its connection's.
    // With as many connections as subscribers, each (the warm ones too)
    // is the one stream of its own connection.
    let conns = if a.h2c_conns == a.subs {
        a.subs + WARM
    } else {
        a.h2c_conns
    };
    let unconnected = usage(&pids);
    let h2_tls = a
        .tls
        .then(|| h2_connector(connector.as_ref().expect("--tls")));
    let h2c: Vec<H2Send> = stream::iter(0..conns)
        .map(|j| {
            let (tls, negotiated) = (h2_tls.as_ref(), &shared.negotiated);
            async move {
                match h2_connect(source(j, a.sources), target, tls, negotiated).await {
                    Some(send) => send,
                    None => panic!("HTTP/2 connection {j} to {target} failed"),
                }
            }
        })
        .buffered(a.inflight)
        .collect()
        .await;
    if conns > 0 {
        // Settled: the server has seen every connection's SETTINGS.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let connected = usage(&pids);
        println!(
            "{conns} HTTP/2 connections{}: RSS {} -> {} KiB, {:.2} KiB each",
            if a.tls { " over TLS" } else { "" },
            unconnected.rss,
            connected.rss,
            (connected.rss as f64 - unconnected.rss as f64) / conns as f64
        );
    }
    // Subscriber i: a socket of its own, or a stream of h2c connection
    // i mod --h2c-conns.
    let spawn = |i: usize| match h2c.get(i % h2c.len().max(1)) {
        Some(send) => tokio::spawn(h2c_subscriber(
            shared.clone(),
            send.clone(),
            controlled.clone(),
        )),
        None if a.tls => tokio::spawn(tls_subscriber(
            shared.clone(),
            source(i, a.sources),
            controlled.clone(),
        )),
        None => tokio::spawn(subscriber(
            shared.clone(),
            source(i, a.sources),
            controlled.clone(),
        )),
    };

    // A few subscriptions first, so that the resource (or channel) exists
    // before the baseline is taken.
    let mut warm: Vec<tokio::task::JoinHandle<SubResult>> = Vec::new();
    for i in 0..WARM {
        warm.push(spawn(i));
    }
    wait_until(Instant::now() + Duration::from_secs(20), || {
        shared.ready.load(Ordering::Relaxed) + shared.refused.load(Ordering::Relaxed) >= WARM as u64
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let base = usage(&pids);
    let connect_start = Instant::now();
    let mut tasks = Vec::with_capacity(a.subs);
    for i in 0..a.subs {
        tasks.push(spawn(WARM + i));
    }
    let all = (WARM + a.subs) as u64;
    wait_until(Instant::now() + Duration::from_secs(120), || {
        shared.ready.load(Ordering::Relaxed) + shared.refused.load(Ordering::Relaxed) >= all
    })
    .await;
    let connect_secs = connect_start.elapsed().as_secs_f64();
    let connected = shared
        .ready
        .load(Ordering::Relaxed)
        .saturating_sub(WARM as u64);
    tokio::time::sleep(Duration::from_secs_f64(a.settle_secs)).await;
    let subscribed = usage(&pids);
    let per_sub_kib = (subscribed.rss as f64 - base.rss as f64) / connected.max(1) as f64;
    let per_sub_pss_kib = (subscribed.pss as f64 - base.pss as f64) / connected.max(1) as f64;
    println!(
        "{}: {connected}/{} subscribed{} ({} refused) in {connect_secs:.1} s ({} processes): \
         RSS {} -> {} KiB, {per_sub_kib:.2} KiB each (Pss {per_sub_pss_kib:.2} KiB each)",
        name(a.system),
        a.subs,
        match (a.h2c_conns, shared.negotiated.get()) {
            (0, None) => String::new(),
            (0, Some(tls)) => format!(" over TLS ({tls})"),
            (c, None) => format!(" as streams over {c} h2c connections"),
            (c, Some(tls)) => format!(" as streams over {c} TLS connections ({tls})"),
        },
        shared.refused.load(Ordering::Relaxed),
        subscribed.processes,
        base.rss,
        subscribed.rss
    );
    let mut failed = connected == 0;
    let mut report = serde_json::json!({
        "system": name(a.system),
        "scenario": format!("{:?}", a.scenario).to_lowercase(),
        "subs": a.subs,
        "connected": connected,
        "connect_secs": connect_secs,
        "refused": shared.refused.load(Ordering::Relaxed),
        "processes": subscribed.processes,
        "rss_before_kib": base.rss,
        "rss_after_kib": subscribed.rss,
        "rss_per_sub_kib": per_sub_kib,
        "pss_per_sub_kib": per_sub_pss_kib,
        "payload": a.payload,
        "h2c_conns": a.h2c_conns,
        "tls": shared.negotiated.get().cloned(),
        // Over TLS the latencies "to arrival" are to this generator's read.
        "latency_to": if a.tls || !a.stamps || a.h2c_conns > 0 { "read" } else { "arrival" },
    });

    if a.scenario != Scenario::Idle {
        let period = Duration::from_secs_f64(1.0 / a.rate);
        let first_k = match a.system {
            System::Braid => doc.lock().expect("lock").k + 1,
            _ => 1,
        };
        let last_k = first_k + updates - 1;
        shared.last_k.store(last_k, Ordering::Relaxed);
        if a.scenario == Scenario::Stall {
            let _ = control.send(Control::Pause);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let start = Instant::now() + Duration::from_millis(200);
        let _ = shared.schedule.set(Schedule {
            start,
            period,
            first_k,
            last_k,
            start_realtime: realtime_now() + (start - Instant::now()),
        });
        let before = usage(&pids);
        let own_before = usage(&[std::process::id()]);
        let mut failed_publishes = 0u64;
        // When each publish began after its scheduled time (the timer's
        // lateness), and how long its request took to be answered (µs).
        let (mut late, mut took) = (Vec::new(), Vec::new());
        let mut put_conn: Option<PublishTls> = None;
        for i in 0..updates {
            let at = start + period.mul_f64(i as f64);
            // Over TLS, braid-proxy's PUTs go over one keep-alive
            // connection, (re)made before the scheduled time: a handshake
            // per PUT would wait behind a busy proxy's sweeps and make the
            // publisher late.
            if let (Some(c), System::Braid, None) = (&connector, a.system, &put_conn) {
                put_conn = tls_publisher(c, target).await;
            }
            punctual(at).await;
            let began = Instant::now();
            let tls_put = (a.tls && a.system == System::Braid).then_some(&mut put_conn);
            if !publish(&a, target, first_k + i, tls_put).await {
                failed_publishes += 1;
            }
            late.push(began.saturating_duration_since(at).as_micros() as u32);
            took.push(began.elapsed().as_micros() as u32);
        }
        late.sort_unstable();
        took.sort_unstable();
        let published_at = Instant::now();
        if a.scenario == Scenario::Stall {
            // Let the servers queue what they will, then read again.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = control.send(Control::Read);
        }
        let wanted = shared.ready.load(Ordering::Relaxed);
        wait_until(published_at + Duration::from_secs(30), || {
            shared.got_last.load(Ordering::Relaxed) >= wanted
        })
        .await;
        // A little longer, for stragglers still on their way.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let after = usage(&pids);
        let own_after = usage(&[std::process::id()]);
        let window = start.elapsed().as_secs_f64();
        let _ = control.send(Control::Stop);
        // The warm-up subscribers were delivered to as well: count them.
        let mut results = Vec::new();
        for t in warm.drain(..).chain(tasks) {
            results.push(t.await.unwrap_or_default());
        }
        let cpu = after.cpu - before.cpu;
        let expected = updates;
        let (mut missing, mut collapsed, mut deliveries) = (0u64, 0u64, 0u64);
        let mut subs_missing = 0u64;
        let mut stale: Vec<u64> = Vec::new();
        let mut stale_bytes: Vec<u64> = Vec::new();
        let mut without_last = 0u64;
        let mut lat: Vec<u32> = Vec::new();
        let mut lat_read: Vec<u32> = Vec::new();
        let mut unstamped = 0u64;
        // Per update: the first and the last arrival (µs after its
        // scheduled time), to tell a late update from a long sweep.
        let mut per_update: HashMap<u64, (u32, u32)> = HashMap::new();
        for r in results.iter().filter(|r| r.ready) {
            for &(k, l, _) in &r.got {
                let e = per_update.entry(k).or_insert((l, l));
                e.0 = e.0.min(l);
                e.1 = e.1.max(l);
            }
            let got: HashSet<u64> = r.got.iter().map(|&(k, _, _)| k).collect();
            deliveries += got.len() as u64;
            lat.extend(r.got.iter().map(|&(_, l, _)| l));
            lat_read.extend(r.got.iter().map(|&(_, _, l)| l));
            unstamped += r.unstamped;
            let has_last = got.contains(&last_k);
            if !has_last {
                without_last += 1;
            }
            let (m, c) = if a.system == System::Braid {
                // A later version read while an earlier one never came is a
                // collapse, not a loss, when the last version arrived; after
                // the last version read, whatever is missing is lost.
                let newest = got.iter().copied().max().unwrap_or(first_k - 1);
                let lost = last_k - newest;
                (lost, expected - got.len() as u64 - lost)
            } else {
                (expected - got.len() as u64, 0)
            };
            missing += m;
            collapsed += c;
            if m > 0 {
                subs_missing += 1;
            }
            stale.push(got.iter().filter(|&&k| k < last_k).count() as u64);
            stale_bytes.push(r.bytes_after_resume);
        }
        lat.sort_unstable();
        lat_read.sort_unstable();
        failed |= deliveries == 0;
        let subscribers = results.iter().filter(|r| r.ready).count() as u64;
        let expected_all = expected * subscribers;
        report["subscribers_measured"] = subscribers.into();
        report["updates"] = updates.into();
        report["rate"] = a.rate.into();
        report["failed_publishes"] = failed_publishes.into();
        report["deliveries"] = deliveries.into();
        report["expected_deliveries"] = expected_all.into();
        report["missing"] = missing.into();
        report["collapsed"] = collapsed.into();
        report["subscribers_missing_some"] = subs_missing.into();
        report["subscribers_without_last"] = without_last.into();
        report["server_cpu_secs"] = cpu.into();
        report["deliveries_per_cpu_sec"] = (deliveries as f64 / cpu.max(0.01)).into();
        report["server_peak_rss_kib"] = after.hwm.into();
        report["generator_cpu_secs"] = (own_after.cpu - own_before.cpu).into();
        report["window_secs"] = window.into();
        println!(
            "{updates} updates of {} bytes at {}/s ({failed_publishes} publishes failed); \
             deliveries {deliveries}/{expected_all}, missing {missing} \
             ({subs_missing} subscribers), collapsed {collapsed}, without the last {without_last}",
            a.payload, a.rate
        );
        println!(
            "server CPU {cpu:.2} s, {:.0} deliveries per server CPU-second, peak RSS {} KiB; \
             this generator's CPU {:.2} s in the {window:.1} s window",
            deliveries as f64 / cpu.max(0.01),
            after.hwm,
            own_after.cpu - own_before.cpu
        );
        if a.scenario == Scenario::Fanout {
            let line = |lat: &[u32]| {
                format!(
                    "p50 {:.2} p90 {:.2} p99 {:.2} p999 {:.2} max {:.2}",
                    percentile(lat, 0.5),
                    percentile(lat, 0.9),
                    percentile(lat, 0.99),
                    percentile(lat, 0.999),
                    max_ms(lat)
                )
            };
            if a.tls {
                println!(
                    "latency ms from the scheduled publish to this generator's read of the \
                     decrypted update (TLS: no kernel stamp): {}",
                    line(&lat_read)
                );
            } else {
                println!(
                    "latency ms from the scheduled publish to arrival in the socket: {} \
                     ({unstamped} reads without a kernel stamp)",
                    line(&lat)
                );
                println!(
                    "latency ms from the scheduled publish to this generator's read: {}",
                    line(&lat_read)
                );
            }
            let mut slowest: Vec<(u64, u32, u32)> =
                per_update.iter().map(|(&k, &(a, b))| (k, a, b)).collect();
            slowest.sort_unstable_by_key(|&(k, _, _)| k);
            report["per_update"] = slowest
                .iter()
                .map(|&(k, a, b)| serde_json::json!([k, a, b]))
                .collect::<Vec<_>>()
                .into();
            slowest.sort_unstable_by_key(|&(k, _, last)| (std::cmp::Reverse(last), k));
            slowest.truncate(3);
            let ms = |us: u32| f64::from(us) / 1000.0;
            println!(
                "the slowest updates (k: first .. last arrival, ms): {}",
                slowest
                    .iter()
                    .map(|&(k, a, b)| format!("{k}: {:.1} .. {:.1}", ms(a), ms(b)))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            report["slowest_updates"] = slowest
                .iter()
                .map(|&(k, a, b)| serde_json::json!({"k": k, "first_ms": ms(a), "last_ms": ms(b)}))
                .collect::<Vec<_>>()
                .into();
            println!(
                "publishing: began p50 {:.2} p99 {:.2} ms after its scheduled time; \
                 answered in p50 {:.2} p99 {:.2} ms",
                percentile(&late, 0.5),
                percentile(&late, 0.99),
                percentile(&took, 0.5),
                percentile(&took, 0.99)
            );
            report["publish_late_p50_ms"] = percentile(&late, 0.5).into();
            report["publish_late_p99_ms"] = percentile(&late, 0.99).into();
            report["publish_p50_ms"] = percentile(&took, 0.5).into();
            report["publish_p99_ms"] = percentile(&took, 0.99).into();
            report["unstamped_reads"] = unstamped.into();
            // p50_ms ... max_ms to arrival, read_p50_ms ... to the read.
            for (prefix, lat) in [("", &lat), ("read_", &lat_read)] {
                for (name, p) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)] {
                    report[format!("{prefix}{name}_ms")] = percentile(lat, p).into();
                }
                report[format!("{prefix}max_ms")] = max_ms(lat).into();
            }
            // The percentile curve, HdrHistogram style: p = 1 - 10^-x.
            let mut curve = Vec::new();
            for step in 0..=50 {
                let p = 1.0 - 10f64.powf(-(step as f64) / 10.0);
                curve.push(serde_json::json!([p * 100.0, percentile(&lat, p)]));
            }
            curve.push(serde_json::json!([100.0, report["max_ms"].clone()]));
            report["curve"] = curve.into();
        } else {
            stale.sort_unstable();
            stale_bytes.sort_unstable();
            let mean = stale.iter().sum::<u64>() as f64 / stale.len().max(1) as f64;
            let median = stale.get(stale.len() / 2).copied().unwrap_or(0);
            let max = stale.last().copied().unwrap_or(0);
            let median_bytes = stale_bytes.get(stale_bytes.len() / 2).copied().unwrap_or(0);
            println!(
                "stalled readers: stale updates read before the current one: \
                 mean {mean:.1}, median {median}, max {max}; median bytes read after resuming {median_bytes}"
            );
            report["stale_mean"] = mean.into();
            report["stale_median"] = median.into();
            report["stale_max"] = max.into();
            report["bytes_after_resume_median"] = median_bytes.into();
        }
    } else {
        let _ = control.send(Control::Stop);
        for t in tasks {
            let _ = t.await;
        }
    }
    for t in warm {
        let _ = t.await;
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report).expect("json")).expect("--json");
    }
    drop(child);
    if let Some(dir) = certs_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    if failed {
        eprintln!("failed: nobody subscribed, or nothing was delivered");
        std::process::exit(1);
    }
}
