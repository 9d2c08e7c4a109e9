//! Purges flow down the tree (issue 50, spec/tiers.md): a purge or refresh
//! at any tier reaches every tier below it through the purge feed each
//! braid-proxy serves its downstream tiers, and never goes up or sideways.
//! Every tier is the crate's `Server` on 127.0.0.1:0, the origin a plain
//! REST server whose answers may be stored for ten minutes; clients are
//! hyper on real sockets.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_proxy::config::{Config, UpstreamPurges};
use bytes::Bytes;
use http::Response;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::net::{TcpListener, TcpStream};

use common::origin::Origin;
use common::tier::{self, Tier};
use common::{body_of, request};

/// The host every client asks for (one variant at every tier).
const HOST: &str = "news.example";
/// Another host, whose answers are other variants of each URL.
const OTHER_HOST: &str = "sport.example";
/// Bound of every wait in these tests.
const WAIT: Duration = Duration::from_secs(10);
/// How soon a purge at the top must show at the bottom (issue 50: "within
/// about a second").
const PROPAGATION: Duration = Duration::from_millis(1000);

/// The origin of every test: answers stored for ten minutes, each path
/// tagged (`Surrogate-Key`).
fn origin() -> Origin {
    Origin::with_cache_control("max-age=600")
}

/// A tier as tests/chaining.rs runs them, polling only every 30 s:
/// changes come only by purge and refresh here.
fn config(id: &str, upstream: SocketAddr, listen: SocketAddr) -> Config {
    Config {
        poll_interval: Duration::from_secs(30),
        ..tier::config(id, upstream, listen)
    }
}

/// What these tests do with a tier: GETs that tell whether it answered
/// from state, admin purges, and waits on its purge feed.
impl Tier {
    /// A tier whose upstream is `upstream`, on a fresh port.
    async fn below(id: &str, upstream: SocketAddr) -> Tier {
        Tier::start(config(id, upstream, "127.0.0.1:0".parse().expect("addr"))).await
    }

    /// A GET: (body, whether this tier answered it from its stored state).
    async fn get(&self, path: &str) -> (String, bool) {
        self.get_as(HOST, path).await
    }

    /// As [`Tier::get`], for a client asking for `host`.
    async fn get_as(&self, host: &str, path: &str) -> (String, bool) {
        let response = request(self.addr, "GET", path, &[("host", host)]).await;
        assert_eq!(response.status(), 200, "{}: GET {path}", self.id);
        let statuses: Vec<String> = response
            .headers()
            .get_all("cache-status")
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_string))
            .collect();
        let hit = statuses
            .iter()
            .flat_map(|v| v.split(','))
            .any(|entry| entry.trim().starts_with(&format!("\"{}\"; hit", self.id)));
        let body = body_of(response).await;
        (String::from_utf8_lossy(&body).into_owned(), hit)
    }

    /// GETs `path` until this tier answers it from state with `body`:
    /// stored here (the first open of the purge feed purges everything
    /// stored before it, so this may take a second GET).
    async fn store(&self, path: &str, body: &str) {
        self.store_as(HOST, path, body).await;
    }

    /// As [`Tier::store`], for a client asking for `host`.
    async fn store_as(&self, host: &str, path: &str, body: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let (got, hit) = self.get_as(host, path).await;
            if hit && got == body {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {path} not stored as {body:?} (got {got:?}, hit {hit})",
                self.id
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// GETs `path` until it is `body`; how long that took.
    async fn until(&self, path: &str, body: &str, within: Duration) -> Duration {
        self.until_as(HOST, path, body, within).await
    }

    /// As [`Tier::until`], for a client asking for `host`.
    async fn until_as(&self, host: &str, path: &str, body: &str, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let (got, _) = self.get_as(host, path).await;
            if got == body {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "{}: {path} still {got:?} after {within:?}, expected {body:?}",
                self.id
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `POST /purge?...` or `/refresh?...` on the admin listener.
    async fn admin(&self, target: &str) -> (u16, String) {
        let response = request(self.admin, "POST", target, &[]).await;
        let status = response.status().as_u16();
        let body = body_of(response).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

async fn get_text(addr: SocketAddr, path: &str) -> (u16, String) {
    let response = request(addr, "GET", path, &[]).await;
    let status = response.status().as_u16();
    let body = body_of(response).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// origin ← top ← middle ← bottom, each following the one above.
async fn three_tiers(origin: &Origin) -> (Tier, Tier, Tier) {
    let origin_addr = origin.start().await;
    let top = Tier::below("top", origin_addr).await;
    let middle = Tier::below("middle", top.addr).await;
    let bottom = Tier::below("bottom", middle.addr).await;
    (top, middle, bottom)
}

/// Stores `path` at every tier of the chain (bottom first, so that the
/// tiers learn their upstreams and open their feeds), then checks that
/// each serves it from state.
async fn store_everywhere(tiers: &[&Tier], path: &str, body: &str) {
    tiers[tiers.len() - 1].get(path).await;
    for tier in &tiers[1..] {
        tier.wait_following().await;
    }
    for tier in tiers.iter().rev() {
        tier.store(path, body).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_purge_at_the_top_reaches_depth_two_and_three() {
    let origin = origin();
    origin.set_tagged("/news", "old news", "news");
    origin.set_tagged("/sport", "old sport", "sport");
    let (top, middle, bottom) = three_tiers(&origin).await;
    let tiers = [&top, &middle, &bottom];
    store_everywhere(&tiers, "/news", "old news").await;
    store_everywhere(&tiers, "/sport", "old sport").await;

    origin.set_tagged("/news", "new news", "news");
    origin.set_tagged("/sport", "new sport", "sport");
    // Stored for ten minutes: nothing below has a reason to ask.
    assert_eq!(bottom.get("/news").await, ("old news".to_string(), true));
    assert_eq!(middle.get("/news").await, ("old news".to_string(), true));

    let purged_at = Instant::now();
    assert_eq!(
        top.admin("/purge?tag=news").await,
        (200, "purged 1\n".into())
    );
    let depth2 = middle.until("/news", "new news", PROPAGATION).await;
    bottom.until("/news", "new news", PROPAGATION).await;
    eprintln!(
        "tag purge: depth 2 new after {depth2:?}, depth 2 and 3 after {:?}",
        purged_at.elapsed()
    );
    // The other tag's answers are still stored, everywhere.
    for tier in tiers {
        assert_eq!(tier.get("/sport").await, ("old sport".to_string(), true));
    }
    // A tier's Purge-Feed is about the hop it came over: a client of the
    // bottom tier gets the origin's answer without the middle tier's.
    let answer = common::get(bottom.addr, "/sport", &[]).await;
    assert!(
        !answer.headers().contains_key("purge-feed"),
        "{:?}",
        answer.headers()
    );
    bottom
        .wait_metric("purge_feed_received_total", |v| v >= 1.0, "got the purge")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_purge_at_the_top_reaches_depth_two_and_three() {
    let origin = origin();
    origin.set_tagged("/doc", "version 1", "docs");
    origin.set_tagged("/other", "other 1", "docs");
    let (top, middle, bottom) = three_tiers(&origin).await;
    let tiers = [&top, &middle, &bottom];
    store_everywhere(&tiers, "/doc", "version 1").await;
    store_everywhere(&tiers, "/other", "other 1").await;

    origin.set_tagged("/doc", "version 2", "docs");
    origin.set_tagged("/other", "other 2", "docs");
    assert_eq!(bottom.get("/doc").await, ("version 1".to_string(), true));

    let purged_at = Instant::now();
    assert_eq!(
        top.admin("/purge?path=/doc").await,
        (200, "purged 1\n".into())
    );
    bottom.until("/doc", "version 2", PROPAGATION).await;
    eprintln!("path purge: depth 3 new after {:?}", purged_at.elapsed());
    middle.until("/doc", "version 2", PROPAGATION).await;
    for tier in tiers {
        assert_eq!(tier.get("/other").await, ("other 1".to_string(), true));
    }
    // A purge in the middle reaches the bottom, not the top.
    origin.set_tagged("/other", "other 3", "docs");
    assert_eq!(
        middle.admin("/purge?path=/other").await,
        (200, "purged 1\n".into())
    );
    bottom.until("/other", "other 1", PROPAGATION).await;
    assert_eq!(top.get("/other").await, ("other 1".to_string(), true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_at_the_top_reaches_subscribers_and_stored_answers_below() {
    let origin = origin();
    origin.set_tagged("/live", "live 1", "live");
    let (top, middle, bottom) = three_tiers(&origin).await;
    let tiers = [&top, &middle, &bottom];
    store_everywhere(&tiers, "/live", "live 1").await;
    // Subscribers at depth 2 and 3, and stored answers of another variant
    // (another host: not answered from the subscriptions) at every tier.
    let mut subscribers = Vec::new();
    for tier in [&middle, &bottom] {
        let headers = [("host", HOST), ("subscribe", "true")];
        let response = request(tier.addr, "GET", "/live", &headers).await;
        assert_eq!(response.status(), 209);
        subscribers.push((tier.id.clone(), response.into_body(), String::new()));
    }
    for (id, body, seen) in &mut subscribers {
        read_until(body, seen, "\"e1\"", id).await;
    }
    for tier in [&bottom, &middle, &top] {
        tier.store_as(OTHER_HOST, "/live", "live 1").await;
    }

    origin.set_tagged("/live", "live 2", "live");
    let started = Instant::now();
    assert_eq!(
        top.admin("/refresh?path=/live").await,
        (202, "refreshing\n".into())
    );
    for (id, body, seen) in &mut subscribers {
        read_until(body, seen, "\"e2\"", id).await;
    }
    let refreshed = started.elapsed();
    assert!(
        refreshed < PROPAGATION,
        "subscribers new after {refreshed:?}"
    );
    bottom
        .until_as(OTHER_HOST, "/live", "live 2", PROPAGATION)
        .await;
    eprintln!(
        "refresh: subscribers at depth 2 and 3 new after {refreshed:?}, a stored answer at depth 3 after {:?}",
        started.elapsed()
    );
}

/// Reads a subscription until its text holds `want`, bounded.
async fn read_until(body: &mut Incoming, seen: &mut String, want: &str, id: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !seen.contains(want) {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .unwrap_or_else(|_| panic!("{id}: no {want:?} in time; saw {seen:?}"))
            .unwrap_or_else(|| panic!("{id}: stream ended before {want:?}"))
            .expect("frame");
        if let Ok(data) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
}

/// A TCP relay between two tiers whose connections the test can cut.
struct Cable {
    addr: SocketAddr,
    open: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Cable {
    async fn to(target: SocketAddr) -> Cable {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let open = Arc::new(AtomicBool::new(true));
        let links: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (accepting, held) = (open.clone(), links.clone());
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                if !accepting.load(SeqCst) {
                    continue;
                }
                let link = tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                held.lock().expect("lock").push(link.abort_handle());
            }
        });
        Cable { addr, open, links }
    }

    /// Closes every connection through it and refuses new ones.
    fn cut(&self) {
        self.open.store(false, SeqCst);
        for link in self.links.lock().expect("lock").drain(..) {
            link.abort();
        }
    }

    fn mend(&self) {
        self.open.store(true, SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_whose_feed_was_cut_resumes_it_and_serves_nothing_stale() {
    let origin = origin();
    origin.set_tagged("/news", "old news", "news");
    origin.set_tagged("/doc", "doc 1", "docs");
    let origin_addr = origin.start().await;
    let top = Tier::below("top", origin_addr).await;
    let cable = Cable::to(top.addr).await;
    let edge = Tier::below("edge", cable.addr).await;
    store_everywhere(&[&top, &edge], "/news", "old news").await;
    store_everywhere(&[&top, &edge], "/doc", "doc 1").await;
    let resyncs = edge.metric("purge_feed_resyncs_total").await;

    cable.cut();
    edge.wait_metric("purge_feed_following", |v| v == 0.0, "lost the feed")
        .await;
    // Purges while the edge is away.
    origin.set_tagged("/news", "new news", "news");
    origin.set_tagged("/doc", "doc 2", "docs");
    assert_eq!(
        top.admin("/purge?tag=news").await,
        (200, "purged 1\n".into())
    );
    assert_eq!(
        top.admin("/purge?path=/doc").await,
        (200, "purged 1\n".into())
    );
    assert_eq!(top.get("/news").await.0, "new news");
    cable.mend();
    edge.wait_following().await;
    edge.wait_metric("purge_feed_received_total", |v| v >= 2.0, "got both purges")
        .await;
    assert_eq!(edge.get("/news").await.0, "new news");
    assert_eq!(edge.get("/doc").await.0, "doc 2");
    // It resumed from where it was: the window held its place, so nothing
    // more than the two purges was dropped.
    assert_eq!(edge.metric("purge_feed_resyncs_total").await, resyncs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_middle_tier_makes_the_tier_below_drop_what_it_stored() {
    let origin = origin();
    origin.set_tagged("/news", "old news", "news");
    let (top, middle, bottom) = three_tiers(&origin).await;
    store_everywhere(&[&top, &middle, &bottom], "/news", "old news").await;
    let resyncs = bottom.metric("purge_feed_resyncs_total").await;

    let listen = middle.addr;
    middle.kill().await;
    bottom
        .wait_metric("purge_feed_following", |v| v == 0.0, "lost the feed")
        .await;
    // A purge at the top while the middle tier is away: nobody is left
    // to pass it to the bottom.
    origin.set_tagged("/news", "new news", "news");
    assert_eq!(
        top.admin("/purge?tag=news").await,
        (200, "purged 1\n".into())
    );
    assert_eq!(bottom.get("/news").await, ("old news".to_string(), true));

    let middle = Tier::start(config("middle", top.addr, listen)).await;
    bottom.wait_following().await;
    // The restarted middle tier has another boot id: the bottom cannot
    // know what it missed, and drops everything it stored.
    bottom
        .wait_metric(
            "purge_feed_resyncs_total",
            |v| v > resyncs,
            "purged everything",
        )
        .await;
    assert_eq!(bottom.get("/news").await.0, "new news");
    assert_eq!(middle.get("/news").await.0, "new news");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_at_an_edge_goes_down_but_never_up_or_sideways() {
    let origin = origin();
    origin.set_tagged("/news", "old news", "news");
    let origin_addr = origin.start().await;
    let shield = Tier::below("shield", origin_addr).await;
    let edge = Tier::below("edge", shield.addr).await;
    let sibling = Tier::below("sibling", shield.addr).await;
    let third = Tier::below("third", edge.addr).await;
    store_everywhere(&[&shield, &edge, &third], "/news", "old news").await;
    store_everywhere(&[&shield, &sibling], "/news", "old news").await;
    let asked = origin.asked("/news");
    let received = third.metric("purge_feed_received_total").await;

    origin.set_tagged("/news", "new news", "news");
    assert_eq!(
        edge.admin("/purge?tag=news").await,
        (200, "purged 1\n".into())
    );
    // Down: the tier below the edge got it and dropped its answer (what
    // it gets again is the shield's, still stored there).
    third
        .wait_metric(
            "purge_feed_received_total",
            |v| v > received,
            "got the edge's purge",
        )
        .await;
    assert_eq!(third.get("/news").await, ("old news".to_string(), false));
    // Not up, not sideways: the shield and the sibling edge still hold
    // their answers, and the origin was not asked again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(shield.get("/news").await, ("old news".to_string(), true));
    assert_eq!(sibling.get("/news").await, ("old news".to_string(), true));
    assert_eq!(shield.metric("purge_feed_received_total").await, 0.0);
    assert_eq!(sibling.metric("purge_feed_received_total").await, 0.0);
    assert_eq!(origin.asked("/news"), asked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_is_read_only_and_for_trusted_downstream_tiers() {
    let origin = origin();
    let origin_addr = origin.start().await;
    let open = Tier::below("open", origin_addr).await;
    let mut closed_config = config("closed", origin_addr, "127.0.0.1:0".parse().expect("addr"));
    closed_config.trusted_downstream = Default::default();
    let closed = Tier::start(closed_config).await;
    let feed = "/.well-known/braid-proxy/purges";
    let subscribe = [("subscribe", "true")];
    let refused = request(closed.addr, "GET", feed, &subscribe).await;
    assert_eq!(refused.status(), 403);
    for method in ["POST", "PUT", "DELETE"] {
        let response = request(open.addr, method, feed, &[]).await;
        assert_eq!(response.status(), 405, "{method}");
    }
    // Answered by the proxy, never asked of the origin.
    assert_eq!(origin.asked(feed), 0);
    // A plain GET names the current version; a subscription starts there.
    let (status, _) = get_text(open.addr, feed).await;
    assert_eq!(status, 200);
    open.admin("/purge?tag=a%20b").await;
    let plain = request(open.addr, "GET", feed, &[]).await;
    let current = plain.headers()["current-version"]
        .to_str()
        .expect("text")
        .to_string();
    assert!(current.ends_with("-1\""), "{current}");
    let mut response = request(open.addr, "GET", feed, &subscribe).await;
    assert_eq!(response.status(), 209);
    assert_eq!(response.headers()["current-version"], current.as_str());
    open.admin("/refresh?path=/x%3Fy").await;
    let mut seen = String::new();
    read_until(response.body_mut(), &mut seen, "/x?y", "open").await;
    assert!(
        seen.contains(r#"{"action":"refresh","path":"/x?y"}"#),
        "{seen}"
    );
    assert!(seen.contains(&format!("Parents: {current}")), "{seen}");
    // Resuming from a version of another boot: one update that purges all.
    let gone = [("subscribe", "true"), ("parents", "\"0000-7\"")];
    let mut response = request(open.addr, "GET", feed, &gone).await;
    let mut seen = String::new();
    read_until(response.body_mut(), &mut seen, "\"all\":true", "open").await;
    assert!(!seen.contains("Parents"), "{seen}");
    // Resuming from the first purge: the refresh after it, not the purge.
    let from_first = [("subscribe", "true"), ("parents", current.as_str())];
    let mut response = request(open.addr, "GET", feed, &from_first).await;
    let mut seen = String::new();
    read_until(response.body_mut(), &mut seen, "/x?y", "open").await;
    assert!(!seen.contains("a b"), "{seen}");
}

/// An upstream that serves a purge feed of its own making: one update
/// that does not parse as a purge, then a good one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_feed_updates_are_ignored() {
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    let upstream = common::serve(move |req| {
        if req.uri().path() != "/.well-known/braid-proxy/purges" {
            return Response::builder()
                .status(404)
                .body(Full::new(Bytes::new()))
                .expect("response");
        }
        counter.fetch_add(1, SeqCst);
        let update = |version: &str, parents: &str, body: &str| {
            format!(
                "Version: \"{version}\"\r\nParents: \"{parents}\"\r\nContent-Length: {}\r\n\r\n{body}\r\n\r\n",
                body.len()
            )
        };
        let mut text = update("b00t-1", "b00t-0", "{\"action\":\"explode\"}");
        text.push_str(&update("b00t-2", "b00t-1", "not json at all"));
        text.push_str(&update(
            "b00t-3",
            "b00t-2",
            "{\"action\":\"purge\",\"tag\":\"news\"}",
        ));
        Response::builder()
            .status(209)
            .header("current-version", "\"b00t-0\"")
            .header("heartbeats", "1s")
            .body(Full::new(Bytes::from(text)))
            .expect("response")
    })
    .await;
    let mut tuned = config("follower", upstream, "127.0.0.1:0".parse().expect("addr"));
    tuned.upstream_purges = UpstreamPurges::Follow;
    let follower = Tier::start(tuned).await;
    follower
        .wait_metric("purge_feed_received_total", |v| v >= 1.0, "the good purge")
        .await;
    follower
        .wait_metric("purge_feed_ignored_total", |v| v >= 2.0, "the bad ones")
        .await;
    // Its own feed re-published the good one.
    assert!(follower.metric("purge_feed_published_total").await >= 1.0);
    assert!(asked.load(SeqCst) >= 1);
}
