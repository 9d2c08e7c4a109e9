//! Answers are recorded in the order they were asked (issue 38): an origin
//! answer to a request sent before another answer was recorded must not be
//! published over it. Each test holds one origin answer back (computed when
//! the request arrived) while newer answers come in, then lets it go, and a
//! subscriber checks that the version never goes back. Real sockets on
//! 127.0.0.1:0.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// A plain origin whose document is `(n, body)` with ETag `"vN"` and
/// `max-age=0`; it answers `If-None-Match` with 304 and takes `If-Match`
/// PUTs. When `hold` is set, the next GET's answer (computed on arrival,
/// `If-None-Match` ignored) waits for `release`.
struct Origin {
    addr: SocketAddr,
    doc: Arc<Mutex<(u64, String)>>,
    hold: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
    release: Arc<Notify>,
}

impl Origin {
    async fn start(body: &str) -> Origin {
        let doc = Arc::new(Mutex::new((1, body.to_string())));
        let hold = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let (d, h, c, r) = (doc.clone(), hold.clone(), held.clone(), release.clone());
        let addr = common::serve_async(move |req: Request<Incoming>| {
            let (doc, hold, held, release) = (d.clone(), h.clone(), c.clone(), r.clone());
            async move {
                let (n, body) = doc.lock().expect("doc").clone();
                let etag = format!("\"v{n}\"");
                if req.method() == Method::PUT {
                    let matches = req
                        .headers()
                        .get("if-match")
                        .is_none_or(|v| v.as_bytes() == etag.as_bytes());
                    if !matches {
                        return status(StatusCode::PRECONDITION_FAILED);
                    }
                    let bytes = req.into_body().collect().await.expect("body").to_bytes();
                    *doc.lock().expect("doc") =
                        (n + 1, String::from_utf8_lossy(&bytes).into_owned());
                    return Response::builder()
                        .header("etag", format!("\"v{}\"", n + 1))
                        .body(Full::new(Bytes::new()))
                        .expect("response");
                }
                if hold.swap(false, Ordering::SeqCst) {
                    held.fetch_add(1, Ordering::SeqCst);
                    release.notified().await;
                } else if req
                    .headers()
                    .get("if-none-match")
                    .is_some_and(|v| v.as_bytes() == etag.as_bytes())
                {
                    let mut r = status(StatusCode::NOT_MODIFIED);
                    r.headers_mut().insert("etag", etag.parse().expect("etag"));
                    return r;
                }
                Response::builder()
                    .header("etag", etag)
                    .header("cache-control", "max-age=0")
                    .header("content-type", "text/plain")
                    .body(Full::new(Bytes::from(body)))
                    .expect("response")
            }
        })
        .await;
        Origin {
            addr,
            doc,
            hold,
            held,
            release,
        }
    }

    /// Holds the next GET; returns once it has arrived and is held.
    async fn hold_next(&self, send: impl std::future::Future<Output = ()>) {
        let before = self.held.load(Ordering::SeqCst);
        self.hold.store(true, Ordering::SeqCst);
        send.await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.held.load(Ordering::SeqCst) == before {
            assert!(Instant::now() < deadline, "the held GET never came");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Sends a client GET of /doc that the origin holds. A GET that arrives
    /// while the subscription's first fetch is being recorded is answered
    /// by that fetch (it never reaches the origin); such a GET is sent
    /// again, a bounded number of times.
    async fn held_get(&self, proxy: SocketAddr) -> tokio::task::JoinHandle<Response<Incoming>> {
        for _ in 0..20 {
            let before = self.held.load(Ordering::SeqCst);
            self.hold.store(true, Ordering::SeqCst);
            let client = tokio::spawn(async move { common::get(proxy, "/doc", &[]).await });
            let deadline = Instant::now() + Duration::from_secs(5);
            while self.held.load(Ordering::SeqCst) == before && !client.is_finished() {
                assert!(Instant::now() < deadline, "the held GET never came");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if self.held.load(Ordering::SeqCst) != before {
                return client;
            }
            // Answered without the origin: say how, and try again.
            let answer = client.await.expect("client");
            eprintln!(
                "a GET was answered without the origin: {} {:?}",
                answer.status(),
                answer.headers().get("cache-status")
            );
        }
        panic!("every GET was answered without the origin");
    }

    /// Changes the document at the origin (not through the proxy).
    fn change(&self, body: &str) {
        let mut doc = self.doc.lock().expect("doc");
        *doc = (doc.0 + 1, body.to_string());
    }
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = code;
    r
}

/// A raw subscription that records every `Version` it is told, in order.
struct Subscriber {
    stream: TcpStream,
    text: String,
}

impl Subscriber {
    async fn open(addr: SocketAddr) -> Subscriber {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        // The host `common::get` sends: one variant for both.
        let head = format!("GET /doc HTTP/1.1\r\nHost: {addr}\r\nSubscribe: true\r\n\r\n");
        stream.write_all(head.as_bytes()).await.expect("write");
        Subscriber {
            stream,
            text: String::new(),
        }
    }

    /// Reads until `want` is among the versions seen (or `wait` passes);
    /// true when seen.
    async fn until(&mut self, want: u64, wait: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        let mut buf = [0u8; 8192];
        while !self.versions().contains(&want) {
            match tokio::time::timeout_at(deadline, self.stream.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => self.text.push_str(&String::from_utf8_lossy(&buf[..n])),
                _ => return false,
            }
        }
        true
    }

    /// Every `Version: "vN"` line (head and updates), as N, in order.
    fn versions(&self) -> Vec<u64> {
        self.text
            .lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(':')?;
                if !name.eq_ignore_ascii_case("version") {
                    return None;
                }
                value
                    .trim()
                    .trim_matches('"')
                    .strip_prefix('v')?
                    .parse()
                    .ok()
            })
            .collect()
    }

    /// Fails when a version came after a newer one.
    fn assert_never_back(&self) {
        let seen = self.versions();
        for pair in seen.windows(2) {
            assert!(
                pair[1] >= pair[0],
                "version went back from v{} to v{}: {seen:?}\n{}",
                pair[0],
                pair[1],
                self.text
            );
        }
    }
}

async fn refresh(admin: SocketAddr) {
    let response = common::request(admin, "POST", "/refresh?path=/doc", &[]).await;
    assert_eq!(response.status().as_u16(), 202);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_answered_after_a_newer_poll_is_not_recorded_over_it() {
    let origin = Origin::start("one").await;
    let (proxy, admin) = common::proxy_for(origin.addr, |_| {}).await;
    let mut sub = Subscriber::open(proxy).await;
    assert!(sub.until(1, Duration::from_secs(5)).await, "{}", sub.text);
    // A client's GET (stale: max-age=0) goes to the origin, which computes
    // its answer (v1) and holds it...
    let client = origin.held_get(proxy).await;
    // ...while the document changes and a poll records v2.
    origin.change("two");
    refresh(admin).await;
    assert!(sub.until(2, Duration::from_secs(5)).await, "{}", sub.text);
    // The GET's answer comes now; its client gets what it was answered.
    origin.release.notify_one();
    let response = client.await.expect("client");
    assert_eq!(&common::body_of(response).await[..], b"one");
    // The subscriber is not told v1 again, and state stays at v2.
    assert!(!sub.until(3, Duration::from_millis(800)).await);
    sub.assert_never_back();
    let mut late = Subscriber::open(proxy).await;
    assert!(late.until(2, Duration::from_secs(5)).await, "{}", late.text);
    assert!(late.versions().iter().all(|v| *v == 2), "{}", late.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_held_across_a_put_and_a_newer_get_is_not_recorded() {
    let origin = Origin::start("one").await;
    let (proxy, admin) = common::proxy_for(origin.addr, |_| {}).await;
    let mut sub = Subscriber::open(proxy).await;
    assert!(sub.until(1, Duration::from_secs(5)).await, "{}", sub.text);
    // A poll goes out; the origin computes v1 and holds the answer.
    origin.hold_next(refresh(admin)).await;
    // A PUT through the proxy lands (v2), and a client's GET records v2.
    let put = common::request(proxy, "PUT", "/doc", &[("content-length", "0")]).await;
    assert_eq!(put.status().as_u16(), 200);
    let got = common::get(proxy, "/doc", &[]).await;
    assert_eq!(&common::body_of(got).await[..], b"");
    assert!(sub.until(2, Duration::from_secs(5)).await, "{}", sub.text);
    // The held poll answer (v1) arrives last.
    origin.release.notify_one();
    assert!(!sub.until(3, Duration::from_millis(800)).await);
    sub.assert_never_back();
    // A 304 for v2 never revives the stored v1 answer for GETs.
    let got = common::get(proxy, "/doc", &[]).await;
    assert_eq!(&common::body_of(got).await[..], b"");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn patch_writes_racing_fast_polls_never_move_a_subscriber_back() {
    let origin = Origin::start("").await;
    // Polls every 2 ms: answers computed before a write landed keep arriving.
    let (proxy, _) = common::proxy_for(origin.addr, |c| {
        c.poll_interval = Duration::from_millis(2);
    })
    .await;
    let mut sub = Subscriber::open(proxy).await;
    assert!(sub.until(1, Duration::from_secs(5)).await, "{}", sub.text);
    let writes = 60;
    for n in 1..=writes {
        let answer = common::exchange(
            proxy,
            format!(
                "PUT /doc HTTP/1.1\r\nHost: {proxy}\r\nParents: \"v{n}\"\r\nVersion: \"v{}\"\r\nContent-Range: text [0:0]\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx",
                n + 1
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "write {n}: {answer}");
    }
    assert!(
        sub.until(writes + 1, Duration::from_secs(5)).await,
        "{}",
        sub.text
    );
    assert!(!sub.until(writes + 2, Duration::from_millis(300)).await);
    sub.assert_never_back();
}
