//! The plain origin's truth, at the origin's price: validators judged as
//! RFC 9110 says (a same-second `Last-Modified` proves nothing), no idle
//! copy named current, a refresh that fetches, heartbeats on time, polls
//! that follow changes, an origin budget and the origin's `Retry-After`.
//! Real sockets on 127.0.0.1, the standard library's `http.server` as
//! the origin where it is the case in point.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use common::origin::Origin;
use common::tier::{self, Tier};
use common::wire::{read_until, versions_in};
use http::Response;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Opens a subscription with extra request headers on a connection of its
/// own; returns the stream and everything read up to the end of the head.
async fn subscribe(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (TcpStream, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    read_until(&mut stream, &mut seen, |t| t.contains("\r\n\r\n")).await;
    (stream, seen)
}

/// The value of a header in a response head, if present.
fn head_value(seen: &[u8], name: &str) -> Option<String> {
    let text = String::from_utf8_lossy(seen);
    let head = text.split("\r\n\r\n").next()?.to_string();
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

/// Reads until `text` has been seen, at most `limit`; whether it was.
async fn seen_within(
    stream: &mut TcpStream,
    seen: &mut Vec<u8>,
    text: &str,
    limit: Duration,
) -> bool {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 16 * 1024];
    while !String::from_utf8_lossy(seen).contains(text) {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return false;
        };
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => seen.extend_from_slice(&buf[..n]),
            Ok(_) => return false,
            Err(_) => return false,
        }
    }
    true
}

/// Reads what comes within `limit` (nothing, at the end of the stream).
async fn read_some(stream: &mut TcpStream, seen: &mut Vec<u8>, limit: Duration) {
    let mut buf = [0u8; 16 * 1024];
    if let Ok(Ok(n)) = tokio::time::timeout(limit, stream.read(&mut buf)).await {
        seen.extend_from_slice(&buf[..n]);
    }
}

/// `python3 -m http.server` serving `dir` on 127.0.0.1 (a port of its
/// own choosing); killed on drop.
struct PythonServer {
    child: std::process::Child,
    addr: SocketAddr,
}

impl PythonServer {
    fn start(dir: &std::path::Path) -> PythonServer {
        use std::io::BufRead;
        // Port 0: the kernel picks; the server prints the one it got.
        let mut child = std::process::Command::new("python3")
            .args(["-u", "-m", "http.server", "--bind", "127.0.0.1", "0"])
            .current_dir(dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 is needed for this test (.ci/run checks for it)");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("banner");
        // "Serving HTTP on 127.0.0.1 port 41234 (http://127.0.0.1:41234/) ..."
        let port: u16 = line
            .split_whitespace()
            .skip_while(|w| *w != "port")
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {line:?}"));
        PythonServer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }
}

impl Drop for PythonServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch directory removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("braid-proxy-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Sleeps until the wall clock is within the first tenth of a second.
async fn start_of_a_second() {
    let into = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .subsec_millis();
    if into > 50 {
        tokio::time::sleep(Duration::from_millis(u64::from(1000 - into) + 10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edits_in_one_second_on_a_last_modified_origin_are_both_seen() {
    // http.server sends Last-Modified to the second, no ETag, and answers
    // If-Modified-Since with 304 when the file's second is not later.
    let dir = Scratch::new("lm-origin");
    let file = dir.0.join("doc.txt");
    std::fs::write(&file, "edit 0\n").expect("write");
    let origin = PythonServer::start(&dir.0);
    let (proxy, _) = common::proxy_for(origin.addr, |c| {
        // Polled often whatever it does: a poll comes between the edits.
        c.poll_interval = Duration::from_millis(100);
        c.poll_max_interval = Some(Duration::from_millis(100));
    })
    .await;
    // A second tier in front of the first: its subscriber must see the same.
    let (edge, _) = common::proxy_for(proxy, |c| {
        c.poll_interval = Duration::from_millis(100);
        c.poll_max_interval = Some(Duration::from_millis(100));
    })
    .await;
    let (mut stream, mut seen) = subscribe(proxy, "/doc.txt", &[]).await;
    assert!(
        seen_within(&mut stream, &mut seen, "edit 0", Duration::from_secs(5)).await,
        "first state: {:?}",
        String::from_utf8_lossy(&seen)
    );
    let (mut far, mut far_seen) = subscribe(edge, "/doc.txt", &[]).await;
    assert!(seen_within(&mut far, &mut far_seen, "edit 0", Duration::from_secs(5)).await);
    // Updates may come as patches: counted by their versions.
    let versions = |seen: &[u8]| versions_in(seen).len();
    for trial in 1..=3 {
        // Both edits within one second, a poll between them.
        start_of_a_second().await;
        let first = format!("edit {trial}a\n");
        let second = format!("edit {trial}b, longer\n");
        let before = versions(&seen);
        std::fs::write(&file, &first).expect("write");
        let deadline = Instant::now() + Duration::from_millis(600);
        while versions(&seen) == before && Instant::now() < deadline {
            read_some(&mut stream, &mut seen, Duration::from_millis(20)).await;
        }
        assert_eq!(
            versions(&seen),
            before + 1,
            "trial {trial}: the first edit is polled within its second"
        );
        std::fs::write(&file, &second).expect("write");
        let deadline = Instant::now() + Duration::from_secs(4);
        while versions(&seen) == before + 1 && Instant::now() < deadline {
            read_some(&mut stream, &mut seen, Duration::from_millis(50)).await;
        }
        assert_eq!(
            versions(&seen),
            before + 2,
            "trial {trial}: the second edit of the same second was lost: {:?}",
            String::from_utf8_lossy(&seen)
        );
        // A plain GET tells the same, at both tiers, and the second tier's
        // subscriber reaches the same version.
        for tier in [proxy, edge] {
            let body = common::body_of(common::get(tier, "/doc.txt", &[]).await).await;
            assert_eq!(body, Bytes::from(second.clone()), "trial {trial}: GET");
        }
        let last = versions_in(&seen).pop().expect("a version");
        read_until(&mut far, &mut far_seen, |t| t.contains(&last)).await;
    }
    assert_eq!(
        versions_in(&far_seen),
        versions_in(&seen),
        "the edge's subscriber"
    );
}

/// An origin whose one document keeps its ETag whatever its body, and
/// answers `If-None-Match` with it by 304: the ETag lies. Varies on
/// `X-Tenant`, whose value it puts in the body.
#[derive(Clone, Default)]
struct LyingOrigin {
    body: Arc<Mutex<String>>,
}

impl LyingOrigin {
    async fn start(&self) -> SocketAddr {
        let me = self.clone();
        common::serve(move |req| {
            let tenant = common::header_text(req.headers(), "x-tenant").unwrap_or("-".into());
            let builder = Response::builder()
                .header("etag", "\"always\"")
                .header("vary", "X-Tenant")
                .header("content-type", "text/plain");
            if req
                .headers()
                .get("if-none-match")
                .is_some_and(|v| v == "\"always\"")
            {
                return builder
                    .status(304)
                    .body(Full::new(Bytes::new()))
                    .expect("response");
            }
            let body = format!("{} for {tenant}\n", me.body.lock().expect("lock"));
            builder
                .body(Full::new(Bytes::from(body)))
                .expect("response")
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_fetches_and_every_variants_subscribers_hear_it() {
    let origin = LyingOrigin::default();
    *origin.body.lock().expect("lock") = "old".into();
    let addr = origin.start().await;
    let (proxy, admin) = common::proxy_for(addr, |c| {
        c.poll_interval = Duration::from_millis(100);
    })
    .await;
    let (mut a, mut seen_a) = subscribe(proxy, "/doc", &[("X-Tenant", "a")]).await;
    let (mut b, mut seen_b) = subscribe(proxy, "/doc", &[("X-Tenant", "b")]).await;
    assert!(seen_within(&mut a, &mut seen_a, "old for a", Duration::from_secs(5)).await);
    assert!(seen_within(&mut b, &mut seen_b, "old for b", Duration::from_secs(5)).await);
    *origin.body.lock().expect("lock") = "new".into();
    // Its polls are answered 304 on the ETag it keeps: nothing tells.
    assert!(
        !seen_within(&mut a, &mut seen_a, "new for a", Duration::from_millis(500)).await,
        "a poll saw through the lying ETag (the test proves nothing then)"
    );
    let answer = common::request(admin, "POST", "/refresh?path=/doc", &[]).await;
    assert_eq!(answer.status(), 202);
    // Each variant's subscriber gets a second version (a patch of "old"
    // into "new"), a version of its own, not the ETag the old one had.
    for (stream, seen) in [(&mut a, &mut seen_a), (&mut b, &mut seen_b)] {
        read_until(stream, seen, |t| t.matches("Version: ").count() >= 2).await;
        let versions = versions_in(seen);
        assert_eq!(versions.len(), 2, "{versions:?}");
        assert_ne!(versions[0], versions[1]);
    }
    assert!(String::from_utf8_lossy(&seen_b).contains("\r\n\r\nnew\r\n"));
    for tenant in ["a", "b"] {
        let body = common::body_of(common::get(proxy, "/doc", &[("X-Tenant", tenant)]).await).await;
        assert_eq!(body, Bytes::from(format!("new for {tenant}\n")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_reaches_a_last_modified_origins_subscribers() {
    // A same-second edit the watcher has not seen yet (its next poll is
    // far off): the refresh fetches it now.
    let dir = Scratch::new("lm-refresh");
    let file = dir.0.join("doc.txt");
    std::fs::write(&file, "before\n").expect("write");
    let origin = PythonServer::start(&dir.0);
    let (proxy, admin) = common::proxy_for(origin.addr, |_| {}).await; // polls every 30 s
    let (mut stream, mut seen) = subscribe(proxy, "/doc.txt", &[]).await;
    assert!(seen_within(&mut stream, &mut seen, "before", Duration::from_secs(5)).await);
    std::fs::write(&file, "after the refresh\n").expect("write");
    let answer = common::request(admin, "POST", "/refresh?path=/doc.txt", &[]).await;
    assert_eq!(answer.status(), 202);
    assert!(
        seen_within(
            &mut stream,
            &mut seen,
            "after the refresh",
            Duration::from_secs(3)
        )
        .await,
        "{:?}",
        String::from_utf8_lossy(&seen)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_resource_is_revalidated_before_a_209_names_its_version() {
    let origin = Origin::default();
    origin.set("/doc", "one\n");
    let addr = origin.start().await;
    let (proxy, _) = common::proxy_for(addr, |c| {
        c.poll_interval = Duration::from_millis(100);
        c.resource_idle = Duration::from_secs(30);
    })
    .await;
    let (mut stream, mut seen) = subscribe(proxy, "/doc", &[]).await;
    assert!(seen_within(&mut stream, &mut seen, "one", Duration::from_secs(5)).await);
    drop(stream);
    // Nobody subscribes; the change is not polled for.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = origin.asked("/doc");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        origin.asked("/doc") <= asked + 1,
        "an idle resource is not polled"
    );
    let tag = origin.set("/doc", "two\n");
    let (mut stream, mut seen) = subscribe(proxy, "/doc", &[]).await;
    assert_eq!(
        head_value(&seen, "current-version").as_deref(),
        Some(format!("\"{tag}\"").as_str()),
        "the 209 names the origin's current version: {:?}",
        String::from_utf8_lossy(&seen)
    );
    read_until(&mut stream, &mut seen, |t| t.contains("two")).await;
    assert!(
        !String::from_utf8_lossy(&seen).contains("one"),
        "the old body was sent as current: {:?}",
        String::from_utf8_lossy(&seen)
    );
}

/// A TCP forwarder standing for haproxy in front of two shields: every
/// new connection goes to the backend chosen now; switching cuts the
/// connections to the old one (its shield died).
struct Failover {
    addr: SocketAddr,
    backend: Arc<Mutex<SocketAddr>>,
    generation: Arc<AtomicUsize>,
}

impl Failover {
    async fn start(first: SocketAddr) -> Failover {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let backend = Arc::new(Mutex::new(first));
        let generation = Arc::new(AtomicUsize::new(0));
        let (to, gen) = (backend.clone(), generation.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = *to.lock().expect("lock");
                let born = gen.load(SeqCst);
                let gen = gen.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
                    let cut = async {
                        while gen.load(SeqCst) == born {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    };
                    tokio::select! {
                        _ = copy => {}
                        _ = cut => {}
                    }
                });
            }
        });
        Failover {
            addr,
            backend,
            generation,
        }
    }

    fn switch_to(&self, backend: SocketAddr) {
        *self.backend.lock().expect("lock") = backend;
        self.generation.fetch_add(1, SeqCst);
    }
}

/// The number in a version `"e<n>"`.
fn number(version: &str) -> u64 {
    version
        .trim_matches('"')
        .trim_start_matches('e')
        .parse()
        .unwrap_or_else(|_| panic!("not a version of the test origin: {version}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_repeated_shield_failovers_no_version_goes_back() {
    let origin = Origin::default();
    origin.set("/doc", "v1\n");
    let origin_addr = origin.start().await;
    let any = "127.0.0.1:0".parse().expect("addr");
    let shield_a = Tier::start(tier::config("shield-a", origin_addr, any)).await;
    let shield_b = Tier::start(tier::config("shield-b", origin_addr, any)).await;
    let front = Failover::start(shield_a.addr).await;
    let mut edge = tier::config("edge", front.addr, any);
    edge.hold_upstream_breaks = Duration::from_secs(5);
    let edge = Tier::start(edge).await;
    let (mut sub, mut seen) = subscribe(edge.addr, "/doc", &[]).await;
    read_until(&mut sub, &mut seen, |t| t.contains("v1")).await;
    let mut serving = shield_a.addr;
    for round in 0..4u64 {
        // The standby shield holds a warm, idle copy: one subscription
        // made it, then left.
        let standby = if serving == shield_a.addr {
            shield_b.addr
        } else {
            shield_a.addr
        };
        let (warm, mut warm_seen) = subscribe(standby, "/doc", &[]).await;
        let mut warm = warm;
        let now = origin.version("/doc");
        read_until(&mut warm, &mut warm_seen, |t| {
            t.contains(&format!("\"e{now}\""))
        })
        .await;
        drop(warm);
        // Meanwhile the origin moves on, seen through the serving shield.
        for _ in 0..2 {
            let n = origin.version("/doc") + 1;
            origin.set("/doc", format!("v{n}\n"));
            read_until(&mut sub, &mut seen, |t| t.contains(&format!("\"e{n}\""))).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The serving shield dies; the edge resumes through the standby,
        // whose copy is older than what the edge has.
        front.switch_to(standby);
        serving = standby;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let n = origin.version("/doc") + 1;
        origin.set("/doc", format!("v{n}\n"));
        read_until(&mut sub, &mut seen, |t| t.contains(&format!("\"e{n}\""))).await;
        let versions: Vec<u64> = versions_in(&seen).iter().map(|v| number(v)).collect();
        assert!(
            versions.windows(2).all(|w| w[0] <= w[1]),
            "round {round}: a version went back: {versions:?}"
        );
    }
    edge.kill().await;
    shield_a.kill().await;
    shield_b.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_heartbeat_comes_within_the_interval() {
    let origin = Origin::default();
    origin.set("/doc", "quiet\n");
    let addr = origin.start().await;
    let (proxy, _) = common::proxy_for(addr, |_| {}).await;
    let (mut stream, mut seen) = subscribe(proxy, "/doc", &[("Heartbeats", "2s")]).await;
    let opened = Instant::now();
    // The whole first update: its chunk ends after the update's blank line.
    read_until(&mut stream, &mut seen, |t| {
        t.contains("quiet\n\r\n\r\n\r\n")
    })
    .await;
    let end = String::from_utf8_lossy(&seen)
        .find("quiet\n\r\n\r\n\r\n")
        .expect("update")
        + "quiet\n\r\n\r\n\r\n".len();
    let mut rest = seen[end..].to_vec();
    // A heartbeat is a chunk holding one blank line.
    const BEAT: &[u8] = b"2\r\n\r\n\r\n";
    let mut beats = Vec::new();
    let mut buf = [0u8; 1024];
    while beats.len() < 2 {
        if rest.len() >= BEAT.len() * (beats.len() + 1) {
            beats.push(opened.elapsed());
            continue;
        }
        let n = tokio::time::timeout(Duration::from_secs(6), stream.read(&mut buf))
            .await
            .expect("a heartbeat within 6 s")
            .expect("read");
        assert!(n > 0, "closed");
        rest.extend_from_slice(&buf[..n]);
    }
    assert_eq!(
        &rest[..2 * BEAT.len()],
        [BEAT, BEAT].concat(),
        "only heartbeats"
    );
    // Clients count 1.5 intervals of silence as a dead stream.
    let slack = Duration::from_millis(500);
    assert!(
        beats[0] <= Duration::from_secs(2) + slack,
        "first heartbeat {:?} after the 209",
        beats[0]
    );
    assert!(
        beats[1] - beats[0] <= Duration::from_secs(2) + slack,
        "heartbeats {:?}",
        beats
    );
    assert!(beats[0] >= Duration::from_millis(900), "{beats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_follows_an_update_delivered_directly_within_the_interval() {
    let origin = Origin::default();
    origin.set("/doc", "before\n");
    let addr = origin.start().await;
    let (proxy, admin) = common::proxy_for(addr, |_| {}).await;
    let (mut stream, mut seen) = subscribe(proxy, "/doc", &[("Heartbeats", "2s")]).await;
    read_until(&mut stream, &mut seen, |t| {
        t.contains("before\n\r\n\r\n\r\n")
    })
    .await;
    // Parked by now: the update is written by the sweep, not the cursor.
    tokio::time::sleep(Duration::from_millis(300)).await;
    origin.set("/doc", "after\n");
    let answer = common::request(admin, "POST", "/refresh?path=/doc", &[]).await;
    assert_eq!(answer.status(), 202);
    read_until(&mut stream, &mut seen, |t| {
        t.matches("Version: ").count() >= 2
    })
    .await;
    read_until(&mut stream, &mut seen, |t| t.ends_with("\r\n\r\n\r\n")).await;
    let updated = Instant::now();
    // The next bytes are a heartbeat, within the interval of the update.
    let mut rest = Vec::new();
    let mut buf = [0u8; 64];
    while rest.len() < 7 {
        let n = tokio::time::timeout(Duration::from_secs(6), stream.read(&mut buf))
            .await
            .expect("a heartbeat within 6 s")
            .expect("read");
        assert!(n > 0, "closed");
        rest.extend_from_slice(&buf[..n]);
    }
    let silence = updated.elapsed();
    assert_eq!(&rest[..7], b"2\r\n\r\n\r\n", "a heartbeat");
    assert!(
        silence <= Duration::from_millis(2500),
        "{silence:?} of silence after an update, for Heartbeats: 2s"
    );
}

/// Counts an origin's requests, all paths together, from a point on.
fn count_since(origin: &Origin) -> impl Fn() -> usize + '_ {
    let start = origin.gets.load(SeqCst);
    move || origin.gets.load(SeqCst) - start
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_resources_are_polled_less_and_a_change_is_still_seen() {
    let origin = Origin::default();
    let paths: Vec<String> = (0..5).map(|i| format!("/quiet{i}")).collect();
    for p in &paths {
        origin.set(p, "still\n");
    }
    let addr = origin.start().await;
    let (proxy, admin) = common::proxy_for(addr, |c| {
        c.poll_interval = Duration::from_millis(100);
        c.poll_max_interval = Some(Duration::from_millis(800));
    })
    .await;
    let mut subs = Vec::new();
    for p in &paths {
        let (mut s, mut seen) = subscribe(proxy, p, &[]).await;
        read_until(&mut s, &mut seen, |t| t.contains("still")).await;
        subs.push((s, seen));
    }
    // The intervals have grown to the ceiling.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let counted = count_since(&origin);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let quiet = counted();
    // 5 resources at 0.8 s (±10%) for 3 s: about 19; at 0.1 s it was 150.
    assert!(quiet <= 30, "{quiet} polls in 3 s for 5 quiet resources");
    assert!(quiet >= 10, "{quiet} polls in 3 s: are they polled at all?");
    let status = common::body_of(common::get(admin, "/status", &[]).await).await;
    let status: serde_json::Value = serde_json::from_slice(&status).expect("json");
    let intervals: Vec<f64> = status["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .filter_map(|r| r["poll_interval_secs"].as_f64())
        .collect();
    assert_eq!(intervals.len(), 5, "{status}");
    assert!(intervals.iter().all(|i| *i >= 0.7), "{intervals:?}");
    // A change is seen within the longest interval.
    origin.set(&paths[2], "changed\n");
    let changed_at = Instant::now();
    let (s, seen) = &mut subs[2];
    assert!(seen_within(s, seen, "changed", Duration::from_secs(3)).await);
    assert!(
        changed_at.elapsed() <= Duration::from_millis(800 + 80 + 400),
        "seen after {:?}",
        changed_at.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_max_interval_equal_to_the_poll_interval_polls_at_it() {
    let origin = Origin::default();
    origin.set("/steady", "same\n");
    let addr = origin.start().await;
    let (proxy, _) = common::proxy_for(addr, |c| {
        c.poll_interval = Duration::from_millis(100);
        c.poll_max_interval = Some(Duration::from_millis(100));
    })
    .await;
    let (mut s, mut seen) = subscribe(proxy, "/steady", &[]).await;
    read_until(&mut s, &mut seen, |t| t.contains("same")).await;
    let counted = count_since(&origin);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let polls = counted();
    assert!((12..=28).contains(&polls), "{polls} polls in 2 s at 100 ms");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_budget_is_never_exceeded() {
    let origin = Origin::default();
    let paths: Vec<String> = (0..30).map(|i| format!("/r{i}")).collect();
    for p in &paths {
        origin.set(p, "x\n");
    }
    let addr = origin.start().await;
    let (proxy, _) = common::proxy_for(addr, |c| {
        c.poll_interval = Duration::from_millis(50);
        c.poll_max_interval = Some(Duration::from_millis(50));
        c.origin_rps = Some(20.0);
    })
    .await;
    let mut subs = Vec::new();
    for p in &paths {
        let (mut s, mut seen) = subscribe(proxy, p, &[]).await;
        read_until(&mut s, &mut seen, |t| t.contains("x\n")).await;
        subs.push((s, seen));
    }
    // Without the budget: 30 resources every 50 ms, 600 a second.
    let counted = count_since(&origin);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let polls = counted();
    let rate = polls as f64 / started.elapsed().as_secs_f64();
    assert!(
        rate <= 21.0,
        "{rate:.1} requests a second against a budget of 20"
    );
    assert!(
        rate >= 15.0,
        "{rate:.1} requests a second: the budget is not spent"
    );
    // A change is still seen, its subscriber waiting its turn.
    origin.set(&paths[7], "moved\n");
    let (s, seen) = &mut subs[7];
    assert!(seen_within(s, seen, "moved", Duration::from_secs(5)).await);
}

/// An origin with `/busy`, which answers 503 with `Retry-After: 2` while
/// `refusing` is set, and `/calm`, counted.
#[derive(Clone, Default)]
struct BusyOrigin {
    refusing: Arc<AtomicBool>,
    asked: Arc<Mutex<HashMap<String, usize>>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_pauses_every_watcher_of_the_origin() {
    let origin = BusyOrigin::default();
    let me = origin.clone();
    let addr = common::serve(move |req| {
        let path = req.uri().path().to_string();
        *me.asked
            .lock()
            .expect("lock")
            .entry(path.clone())
            .or_default() += 1;
        if path == "/busy" && me.refusing.load(SeqCst) {
            return Response::builder()
                .status(503)
                .header("retry-after", "2")
                .body(Full::new(Bytes::new()))
                .expect("response");
        }
        Response::builder()
            .header("etag", "\"1\"")
            .body(Full::new(Bytes::from(format!("{path}\n"))))
            .expect("response")
    })
    .await;
    let asked = |path: &str| {
        origin
            .asked
            .lock()
            .expect("lock")
            .get(path)
            .copied()
            .unwrap_or(0)
    };
    let (proxy, _) = common::proxy_for(addr, |c| {
        c.poll_interval = Duration::from_millis(100);
        c.poll_max_interval = Some(Duration::from_millis(100));
    })
    .await;
    let (mut busy, mut busy_seen) = subscribe(proxy, "/busy", &[]).await;
    read_until(&mut busy, &mut busy_seen, |t| t.contains("/busy")).await;
    let (mut calm, mut calm_seen) = subscribe(proxy, "/calm", &[]).await;
    read_until(&mut calm, &mut calm_seen, |t| t.contains("/calm")).await;
    origin.refusing.store(true, SeqCst);
    let refused_from = asked("/busy");
    let deadline = Instant::now() + Duration::from_secs(3);
    while asked("/busy") == refused_from {
        assert!(Instant::now() < deadline, "/busy was not polled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The 503 came: for its 2 s nobody asks the origin anything (a poll
    // already on its way may land).
    tokio::time::sleep(Duration::from_millis(50)).await;
    let calm_before = asked("/calm");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        asked("/calm") <= calm_before + 1,
        "/calm polled {} times during the origin's Retry-After",
        asked("/calm") - calm_before
    );
    origin.refusing.store(false, SeqCst);
    // After it, polls go on.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        asked("/calm") >= calm_before + 3,
        "/calm not polled after the pause"
    );
}
