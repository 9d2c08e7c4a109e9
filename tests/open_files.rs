//! Open files, over real sockets on loopback: the built binary, started
//! under low descriptor limits, raises its soft limit to the hard one (or
//! sets the one `--max-open-files` names), refuses subscriptions past the
//! reserve with 503 and `Retry-After` instead of hanging, stays reachable
//! (admin listener, plain GETs) while it does, and takes subscriptions
//! again once clients leave. Out of descriptors altogether, its accept
//! loop pauses and logs at most about once a second.
//!
//! The limits are set by a shell around the binary: the crate forbids
//! unsafe code, and with it `pre_exec`.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::wire::{metric, read_until};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

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
async fn out_of_descriptors_the_accept_loop_pauses_and_logs_once_a_second() {
    let proxy = Proxy::start(256, 512, &["--max-open-files", "100"]);
    // Idle connections take every descriptor the proxy has left; the
    // kernel completes the rest of them into the listener's backlog.
    let mut idle = Vec::new();
    for _ in 0..150 {
        idle.push(TcpStream::connect(proxy.client).await.expect("connect"));
    }
    let out_of_files = |log: &str| {
        log.lines()
            .filter(|l| l.contains("accept failed") && l.contains("\"out_of_files\":true"))
            .count()
    };
    let deadline = Instant::now() + WAIT;
    while out_of_files(&proxy.log()) == 0 {
        assert!(
            Instant::now() < deadline,
            "no accept failure logged: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Failing for 4 s: a line every 1 to 1.5 s, where a retry every 50 ms
    // used to log 80.
    let first = out_of_files(&proxy.log());
    tokio::time::sleep(Duration::from_secs(4)).await;
    let lines = out_of_files(&proxy.log()) - first;
    assert!((2..=5).contains(&lines), "{lines} lines in 4 s");

    // Descriptors come back: the proxy answers again.
    drop(idle);
    let deadline = Instant::now() + WAIT;
    loop {
        let get = plain_get(proxy.client, "/notes.txt").await;
        if get.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "no answer: {get}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
