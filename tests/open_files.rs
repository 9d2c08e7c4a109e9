//! Open files, over real sockets on loopback: the built binary, started
//! under low descriptor limits, raises its soft limit to the hard one (or
//! sets the one `--max-open-files` names), refuses subscriptions past the
//! reserve with 503 and `Retry-After` instead of hanging, stays reachable
//! (admin listener, plain GETs) while it does, and takes subscriptions
//! again once clients leave. Connections that send nothing cannot run it
//! out of descriptors (past the last quarter of the reserve new ones are
//! closed at once, logged at most about once a second; the accept loop's
//! pause when it does run out is unit-tested in src/limits.rs). Idle
//! connections end:
//! an HTTP/2 one with no stream open after `--h2-idle-timeout`, and the
//! idlest when descriptors run low, so that they cannot take the
//! descriptors the admin listener and plain GETs need.
//!
//! The limits are set by a shell around the binary: the crate forbids
//! unsafe code, and with it `pre_exec`.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::wire::{metric, read_until};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

const SUBSCRIBE: &[u8] = b"GET /notes.txt HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n";
const WAIT: Duration = Duration::from_secs(10);

/// The binary running under a soft and a hard descriptor limit; killed on drop.
struct Proxy {
    child: Child,
    client: SocketAddr,
    admin: SocketAddr,
    /// The banner event (`--log-format json`).
    banner: serde_json::Value,
    /// Where its stderr goes: a file, so that no pipe fills up.
    log: PathBuf,
}

impl Proxy {
    /// Starts the binary with its demo origin under `ulimit -S -n soft`
    /// and `ulimit -H -n hard`, with `args`.
    fn start(soft: u32, hard: u32, args: &[&str]) -> Proxy {
        let log = std::env::temp_dir().join(format!(
            "braid-proxy-open-files-{}-{soft}-{}.log",
            std::process::id(),
            args.join("_").replace(['-', ' '], "")
        ));
        let stderr = std::fs::File::create(&log).expect("log file");
        let limits = format!("ulimit -S -n {soft} && ulimit -H -n {hard} && exec \"$0\" \"$@\"");
        let (child, client, banner) = common::spawn_proxy(
            Command::new("sh")
                .args(["-c", &limits, env!("CARGO_BIN_EXE_braid-proxy")])
                .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
                .args(["--log-format", "json", "--heartbeat", "0"])
                .args(args)
                .stderr(Stdio::from(stderr)),
        );
        let banner: serde_json::Value = serde_json::from_str(&banner).expect("a JSON banner");
        let admin = banner["admin"]
            .as_str()
            .and_then(|a| a.strip_prefix("http://"))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no admin address: {banner}"));
        Proxy {
            child,
            client: client.parse().expect("client address"),
            admin,
            banner,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A subscription to the demo's `/notes.txt` on a new connection: the
/// connection (open while the subscription lasts) and the response head.
async fn subscribe(client: SocketAddr) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(client).await.expect("connect");
    stream.write_all(SUBSCRIBE).await.expect("subscribe");
    let mut seen = Vec::new();
    read_until(&mut stream, &mut seen, |t| t.contains("\r\n\r\n")).await;
    let head = String::from_utf8_lossy(&seen);
    let head = head
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string();
    (stream, head)
}

async fn plain_get(addr: SocketAddr, path: &str) -> String {
    common::exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
    .await
}

#[tokio::test]
async fn the_soft_limit_is_raised_to_the_hard_one() {
    let proxy = Proxy::start(256, 512, &[]);
    assert_eq!(proxy.banner["open_files"], 512, "{}", proxy.banner);
    assert_eq!(proxy.banner["open_files_was"], 256, "{}", proxy.banner);
    assert_eq!(metric(proxy.admin, "max_fds").await, 512.0);
    let open = metric(proxy.admin, "open_fds").await;
    assert!(open > 3.0 && open < 100.0, "{open} descriptors open");

    let status = plain_get(proxy.admin, "/status").await;
    let json = status.split("\r\n\r\n").nth(1).expect("a body");
    let status: serde_json::Value = serde_json::from_str(json).expect("JSON");
    assert_eq!(status["open_files"]["limit"], 512, "{status}");
    assert_eq!(status["open_files"]["reserve"], 64, "{status}");
    let memory = status["memory"].as_array().expect("memory");
    assert!(
        memory
            .iter()
            .any(|g| g["flag"] == "--max-open-files" && g["cap"] == 512),
        "{memory:?}"
    );
    // 100,000 subscriptions (the default cap) do not fit in 512 files.
    let log = proxy.log();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("--max-subscriptions")),
        "{log}"
    );
}

#[tokio::test]
async fn past_the_reserve_subscriptions_get_503_and_the_proxy_stays_reachable() {
    // Below the hard limit: --max-open-files sets the limit, here lower.
    let proxy = Proxy::start(256, 512, &["--max-open-files", "200"]);
    assert_eq!(proxy.banner["open_files"], 200, "{}", proxy.banner);
    assert_eq!(metric(proxy.admin, "max_fds").await, 200.0);

    // Subscribe until refused: 200 files less the reserve of 64, less the
    // ones the proxy holds anyway (listeners, the demo origin, stdio).
    let mut held = Vec::new();
    let refused = loop {
        assert!(held.len() < 200, "200 subscriptions and no refusal");
        let (stream, head) = subscribe(proxy.client).await;
        if head.starts_with("HTTP/1.1 209") {
            held.push(stream);
            continue;
        }
        break head;
    };
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    let refused = refused.to_ascii_lowercase();
    assert!(refused.contains("\r\nretry-after: "), "{refused}");
    // A refused client that kept its connection would hold a descriptor.
    assert!(refused.contains("\r\nconnection: close"), "{refused}");
    assert!(
        (100..=136).contains(&held.len()),
        "refused after {} subscriptions",
        held.len()
    );

    // Still reachable: the admin listener and a plain GET answer, and a
    // subscription is still refused, not left waiting.
    assert!(
        plain_get(proxy.admin, "/healthz")
            .await
            .starts_with("HTTP/1.1 200"),
        "admin listener"
    );
    let open = metric(proxy.admin, "open_fds").await;
    assert!(open < 200.0, "{open} of 200 descriptors open");
    let get = plain_get(proxy.client, "/notes.txt").await;
    assert!(get.starts_with("HTTP/1.1 200"), "{get}");
    let (_, again) = subscribe(proxy.client).await;
    assert!(again.starts_with("HTTP/1.1 503"), "{again}");

    // Clients leave: subscriptions are taken again.
    held.truncate(held.len() - 20);
    let deadline = Instant::now() + WAIT;
    loop {
        let (stream, head) = subscribe(proxy.client).await;
        if head.starts_with("HTTP/1.1 209") {
            held.push(stream);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still refused after clients left: {head}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rejected = metric(proxy.admin, "subscriptions_rejected_total").await;
    assert!(rejected >= 2.0, "{rejected} refusals counted");
}

#[tokio::test]
async fn connections_that_send_nothing_never_run_the_proxy_out_of_descriptors() {
    let proxy = Proxy::start(256, 512, &["--max-open-files", "100"]);
    // More connections than descriptors, none sending a byte: the kernel
    // completes them all; the proxy serves them up to the last quarter of
    // its reserve and closes the rest at once, where it used to take
    // every descriptor and fail its accepts (EMFILE) until they left.
    let mut idle = Vec::new();
    for _ in 0..150 {
        idle.push(TcpStream::connect(proxy.client).await.expect("connect"));
    }
    let started = Instant::now();
    // The admin listener finds a descriptor at once.
    let health = plain_get(proxy.admin, "/healthz").await;
    assert!(
        health.starts_with("HTTP/1.1 200"),
        "admin listener: {health}"
    );
    // Never out of descriptors: every accept succeeds.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let out_of_files = |log: &str| log.lines().any(|l| l.contains("accept failed"));
    assert!(
        !out_of_files(&proxy.log()),
        "out of descriptors: {}",
        proxy.log()
    );
    let refusals = |log: &str| {
        log.lines()
            .filter(|l| l.contains("a new client connection was closed at once"))
            .count()
    };
    let deadline = Instant::now() + WAIT;
    while refusals(&proxy.log()) == 0 {
        assert!(Instant::now() < deadline, "none refused: {}", proxy.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Once the silent ones are older than a request takes to arrive (1 s),
    // the idlest of them give their descriptors back.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let get = plain_get(proxy.client, "/notes.txt").await;
    assert!(get.starts_with("HTTP/1.1 200"), "a plain GET: {get}");
    let log = proxy.log();
    assert!(!out_of_files(&log), "out of descriptors: {log}");
    // Logged at most about once a second.
    let lines = refusals(&log) as u64;
    assert!(
        lines <= started.elapsed().as_secs() + 2,
        "{lines} lines in {:?}",
        started.elapsed()
    );
    let open = metric(proxy.admin, "open_fds").await;
    assert!(open < 100.0, "{open} of 100 descriptors open");
    drop(idle);
}

/// An h2c connection: its request sender, and its connection task, which
/// ends when the proxy closes the connection.
struct H2c {
    sender: hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>>,
    conn: JoinHandle<()>,
}

impl H2c {
    /// Opens an h2c connection with prior knowledge; `None` when the proxy
    /// does not take it within `within`.
    async fn open(addr: SocketAddr, within: Duration) -> Option<H2c> {
        let opening = async {
            let stream = TcpStream::connect(addr).await.ok()?;
            let (sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                    .await
                    .ok()?;
            let conn = tokio::spawn(async move {
                let _ = conn.await;
            });
            Some(H2c { sender, conn })
        };
        tokio::time::timeout(within, opening).await.ok().flatten()
    }

    /// Sends a GET of `path` with `headers`; the response, or `None` when
    /// none came within `within`.
    async fn get(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        within: Duration,
    ) -> Option<http::Response<hyper::body::Incoming>> {
        let mut req = http::Request::builder().uri(format!("http://x{path}"));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(http_body_util::Empty::new()).expect("request");
        tokio::time::timeout(within, self.sender.send_request(req))
            .await
            .ok()?
            .ok()
    }

    /// Whether the proxy has closed the connection.
    fn closed(&self) -> bool {
        self.conn.is_finished()
    }

    /// Waits (bounded by `within`) for the proxy to close the connection.
    async fn wait_closed(&mut self, within: Duration) -> bool {
        tokio::time::timeout(within, &mut self.conn).await.is_ok()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_h2c_connection_is_closed_and_one_with_a_subscription_is_not() {
    let origin = common::origin::Origin::with_cache_control("max-age=600");
    origin.set("/doc", "a document");
    let origin = origin.start().await;
    let (addr, _) = common::proxy_for(origin, |c| {
        c.h2_idle_timeout = Duration::from_secs(1);
        c.heartbeat = Duration::ZERO;
    })
    .await;

    // One GET, then only PINGs: closed after the idle timeout.
    let mut idle = H2c::open(addr, WAIT).await.expect("h2c connection");
    let response = idle.get("/doc", &[], WAIT).await.expect("an answer");
    assert_eq!(response.status(), 200);
    assert_eq!(common::body_of(response).await, "a document");
    let started = Instant::now();
    assert!(
        idle.wait_closed(WAIT).await,
        "the idle connection stays open"
    );
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900), "closed after {took:?}");

    // A subscription open: never idle, however long it is quiet.
    let mut live = H2c::open(addr, WAIT).await.expect("h2c connection");
    let subscription = live
        .get("/doc", &[("subscribe", "true")], WAIT)
        .await
        .expect("an answer");
    assert_eq!(subscription.status(), 209);
    let mut body = subscription.into_body();
    let first = tokio::time::timeout(WAIT, body.frame())
        .await
        .expect("the first update in time");
    assert!(first.is_some(), "the subscription has a first update");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!live.closed(), "closed with a subscription open");
    // Still serving: another request on it.
    let again = live.get("/doc", &[], WAIT).await.expect("an answer");
    assert_eq!(again.status(), 200);
    drop(again);
    // Its stream ended, it is idle, and closed in turn.
    drop(body);
    assert!(
        live.wait_closed(WAIT).await,
        "the connection stays open after its subscription ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_never_take_the_descriptors_of_the_admin_listener_and_plain_gets() {
    // 250 idle h2c connections against 200 descriptors, with an idle
    // timeout far beyond the test: only the reserve can make room.
    let proxy = Proxy::start(
        256,
        512,
        &["--max-open-files", "200", "--h2-idle-timeout", "1h"],
    );
    let opened = futures_util::future::join_all((0..250).map(|_| async {
        let mut conn = H2c::open(proxy.client, Duration::from_secs(3)).await?;
        let response = conn.get("/notes.txt", &[], Duration::from_secs(3)).await?;
        let status = response.status();
        let _ = tokio::time::timeout(Duration::from_secs(3), common::body_of(response)).await;
        Some((conn, status))
    }))
    .await;
    let served: Vec<_> = opened.into_iter().flatten().collect();
    assert!(
        served.iter().all(|(_, status)| *status == 200),
        "every GET answered was a 200"
    );
    assert!(served.len() >= 100, "only {} GETs answered", served.len());

    // The admin listener and a plain GET still find a descriptor.
    let ready = plain_get(proxy.admin, "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 200"), "/readyz: {ready}");
    let get = plain_get(proxy.client, "/notes.txt").await;
    assert!(get.starts_with("HTTP/1.1 200"), "a plain GET: {get}");
    let open = metric(proxy.admin, "open_fds").await;
    assert!(open < 200.0, "{open} of 200 descriptors open");
    // The idlest were closed to make room (with GOAWAY), not all of them.
    let closed = served.iter().filter(|(c, _)| c.closed()).count();
    assert!(closed > 0, "no idle connection was closed");
    assert!(closed < served.len(), "every idle connection was closed");
}
