//! A quick fan-out measurement: one resource, N subscribers, R writes per
//! second, the proxy in its own process. Not the benchmark suite (a later
//! issue); a first figure for the core path.
//!
//! The program runs its own origin on 127.0.0.1:0 (`/doc`, ETag `"g<k>"`),
//! starts the proxy binary in front of it, opens N subscriptions, then PUTs
//! `/doc` through the proxy R times a second (write-through). Each update's
//! latency is from the write's *scheduled* time (so a stalled writer does
//! not hide delays) to its arrival at a subscriber. It reports deliveries,
//! latency percentiles, the proxy's CPU seconds (from /proc) and its peak
//! RSS. Loopback only; bounded by `--secs`.
//!
//! ```sh
//! cargo build --release --examples
//! ulimit -n 20000
//! taskset -c 1 target/release/examples/fanout --proxy target/release/braid-proxy \
//!     --proxy-cpu 0 --subs 10000 --rate 10 --secs 20
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

struct Args {
    proxy: String,
    proxy_cpu: Option<String>,
    subs: usize,
    rate: f64,
    secs: u64,
    doc_bytes: usize,
}

fn args() -> Args {
    let mut a = Args {
        proxy: "target/release/braid-proxy".into(),
        proxy_cpu: None,
        subs: 1000,
        rate: 10.0,
        secs: 10,
        doc_bytes: 2000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--proxy" => a.proxy = value,
            "--proxy-cpu" => a.proxy_cpu = Some(value),
            "--subs" => a.subs = value.parse().expect("--subs N"),
            "--rate" => a.rate = value.parse().expect("--rate R"),
            "--secs" => a.secs = value.parse().expect("--secs S"),
            "--doc-bytes" => a.doc_bytes = value.parse().expect("--doc-bytes B"),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        a.rate > 0.0 && a.secs > 0 && a.secs <= 600,
        "rate > 0, 0 < secs <= 600"
    );
    a
}

/// The origin's one document: its version number and body.
#[derive(Default)]
struct Doc {
    k: u64,
    body: Bytes,
}

fn body_for(k: u64, bytes: usize) -> Bytes {
    let mut text = String::with_capacity(bytes + 32);
    while text.len() < bytes {
        text.push_str("A line of the document that stays the same.\n");
    }
    text.push_str(&format!("edit number {k}\n"));
    Bytes::from(text)
}

async fn origin(doc: Arc<Mutex<Doc>>, doc_bytes: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let doc = doc.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let doc = doc.clone();
                    async move { Ok::<_, Infallible>(answer(&doc, &req, doc_bytes)) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn answer(doc: &Mutex<Doc>, req: &Request<Incoming>, doc_bytes: usize) -> Response<Full<Bytes>> {
    let mut doc = doc.lock().expect("lock");
    if req.method() == http::Method::PUT {
        doc.k += 1;
        doc.body = body_for(doc.k, doc_bytes);
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
        .header("content-type", "text/plain");
    if same {
        return builder
            .status(304)
            .body(Full::new(Bytes::new()))
            .expect("response");
    }
    builder.body(Full::new(doc.body.clone())).expect("response")
}

/// Starts the proxy; returns its address and process.
async fn start_proxy(a: &Args, upstream: SocketAddr) -> (SocketAddr, tokio::process::Child) {
    let mut cmd = match &a.proxy_cpu {
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
    ])
    .env("RUST_LOG", "warn")
    .stdout(std::process::Stdio::piped())
    .kill_on_drop(true);
    let mut child = cmd.spawn().expect("start the proxy");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    while let Some(line) = lines.next_line().await.expect("proxy output") {
        if let Some(rest) = line.strip_prefix("braid-proxy listening on http://") {
            let addr = rest.trim().parse().expect("proxy address");
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            return (addr, child);
        }
    }
    panic!("the proxy exited before listening");
}

/// Milliseconds since `start` at which write k was scheduled.
struct Schedule {
    start: Instant,
    period: Duration,
    first_k: u64,
}

impl Schedule {
    fn scheduled(&self, k: u64) -> Option<Instant> {
        let i = k.checked_sub(self.first_k)?;
        Some(self.start + self.period.mul_f64(i as f64))
    }
}

/// One subscriber: reads its stream, records the latency of every version.
async fn subscriber(
    proxy: SocketAddr,
    ready: Arc<AtomicU64>,
    schedule: Arc<tokio::sync::OnceCell<Schedule>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<u32> {
    let mut latencies = Vec::new();
    let Ok(mut stream) = TcpStream::connect(proxy).await else {
        return latencies;
    };
    // FANOUT_HYPER_PATH=1 adds a Connection option, which keeps the
    // subscription off the proxy's fast path (src/fastpath.rs): an A/B of
    // the two HTTP/1.1 paths in one binary.
    let request: &[u8] = if std::env::var_os("FANOUT_HYPER_PATH").is_some() {
        b"GET /doc HTTP/1.1\r\nHost: bench\r\nSubscribe: true\r\nConnection: keep-alive, x-bench\r\n\r\n"
    } else {
        b"GET /doc HTTP/1.1\r\nHost: bench\r\nSubscribe: true\r\n\r\n"
    };
    if stream.write_all(request).await.is_err() {
        return latencies;
    }
    let mut buf = vec![0u8; 16 * 1024];
    let mut carry: Vec<u8> = Vec::new();
    let mut counted_ready = false;
    let needle = b"Version: \"g";
    loop {
        let n = tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(n) if n > 0 => n,
                _ => return latencies,
            },
            _ = stop.changed() => return latencies,
        };
        let now = Instant::now();
        carry.extend_from_slice(&buf[..n]);
        let mut pos = 0;
        while let Some(i) = find(&carry[pos..], needle) {
            let start = pos + i + needle.len();
            let Some(end) = carry[start..].iter().position(|&b| b == b'"') else {
                break;
            };
            let k: u64 = std::str::from_utf8(&carry[start..start + end])
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            if !counted_ready {
                counted_ready = true;
                ready.fetch_add(1, Ordering::Relaxed);
            } else if let Some(at) = schedule.get().and_then(|s| s.scheduled(k)) {
                latencies.push(now.saturating_duration_since(at).as_micros() as u32);
            }
            pos = start + end;
        }
        // Keep a tail in case a header is split across reads.
        let keep_from = carry.len().saturating_sub(32).max(pos.min(carry.len()));
        carry.drain(..keep_from);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// (CPU seconds, peak RSS KiB) of a process, from /proc.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // After the command: state is field 3, utime 14 and stime 15 (1-based), in ticks of 1/100 s.
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|v| v.parse::<u64>().ok()))
        .sum();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (ticks as f64 / 100.0, hwm)
}

async fn put(proxy: SocketAddr) {
    if let Ok(mut s) = TcpStream::connect(proxy).await {
        let req =
            b"PUT /doc HTTP/1.1\r\nHost: bench\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx";
        if s.write_all(req).await.is_ok() {
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        }
    }
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    f64::from(sorted[i]) / 1000.0
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    let doc = Arc::new(Mutex::new(Doc {
        k: 0,
        body: body_for(0, a.doc_bytes),
    }));
    let upstream = origin(doc.clone(), a.doc_bytes).await;
    let (proxy, child) = start_proxy(&a, upstream).await;
    // `taskset` execs the proxy, so this is the proxy's pid either way.
    let pid = child.id().expect("proxy pid");
    let ready = Arc::new(AtomicU64::new(0));
    let schedule = Arc::new(tokio::sync::OnceCell::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::with_capacity(a.subs);
    for _ in 0..a.subs {
        tasks.push(tokio::spawn(subscriber(
            proxy,
            ready.clone(),
            schedule.clone(),
            stopped.clone(),
        )));
    }
    let connect_deadline = Instant::now() + Duration::from_secs(60);
    while ready.load(Ordering::Relaxed) < a.subs as u64 && Instant::now() < connect_deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let connected = ready.load(Ordering::Relaxed);
    let (_, rss_idle) = usage(pid);
    let period = Duration::from_secs_f64(1.0 / a.rate);
    let first_k = doc.lock().expect("lock").k + 1;
    let start = Instant::now() + Duration::from_millis(200);
    let _ = schedule.set(Schedule {
        start,
        period,
        first_k,
    });
    let (cpu_before, _) = usage(pid);
    let (own_before, _) = usage(std::process::id());
    let writes = (a.rate * a.secs as f64) as u64;
    for i in 0..writes {
        tokio::time::sleep_until((start + period.mul_f64(i as f64)).into()).await;
        put(proxy).await;
    }
    // Let the last update reach everyone, then stop reading.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu_after, rss_peak) = usage(pid);
    let (own_after, _) = usage(std::process::id());
    let window = start.elapsed().as_secs_f64();
    let _ = stop.send(true);
    let mut all = Vec::new();
    for t in tasks {
        if let Ok(mut l) = t.await {
            all.append(&mut l);
        }
    }
    all.sort_unstable();
    let cpu = cpu_after - cpu_before;
    println!(
        "subscribers {connected}/{}, writes {writes} at {}/s, document {} bytes",
        a.subs, a.rate, a.doc_bytes
    );
    println!("proxy RSS: {rss_idle} KiB with all subscribed, peak {rss_peak} KiB");
    println!(
        "deliveries {} ({:.0}/s), proxy CPU {cpu:.2} s, {:.0} deliveries per proxy CPU-second",
        all.len(),
        all.len() as f64 / a.secs as f64,
        all.len() as f64 / cpu.max(0.01)
    );
    println!(
        "this load generator's own CPU: {:.2} s in the {window:.1} s window (near {window:.1} means it was the bottleneck)",
        own_after - own_before
    );
    println!(
        "latency ms from the scheduled write: p50 {:.2} p90 {:.2} p99 {:.2} p999 {:.2} max {:.2}",
        percentile(&all, 0.5),
        percentile(&all, 0.9),
        percentile(&all, 0.99),
        percentile(&all, 0.999),
        all.last().map_or(f64::NAN, |m| f64::from(*m) / 1000.0)
    );
    drop(child);
}
