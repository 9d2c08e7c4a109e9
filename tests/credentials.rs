//! Credentials that stop working, over real sockets on 127.0.0.1:0: a
//! subscriber whose credential the origin starts refusing (401) is sent
//! the origin's answer as an update within a poll interval and its stream
//! ends; the proxy stops polling with that credential, a new subscription
//! with it gets the origin's 401 (not a 209), and `/readyz` stays 200.
//! Other credentials' subscribers are not affected and never see another
//! credential's state. The same through an edge following a first tier.

mod common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::wire::{dechunk, read_until};

const POLL: Duration = Duration::from_millis(200);
/// The origin's body for a refused credential.
const REFUSED: &str = "token expired or revoked";

/// An origin of one private document per bearer token: `secret v{n} for
/// {token}` to a valid token, 401 with [`REFUSED`] to any other request.
/// It counts the requests each token made. `forbidden`: it refuses with
/// 403 instead.
#[derive(Clone, Default)]
struct Origin {
    forbidden: bool,
    valid: Arc<Mutex<HashSet<String>>>,
    version: Arc<Mutex<u32>>,
    asked: Arc<Mutex<HashMap<String, usize>>>,
}

impl Origin {
    fn allow(&self, token: &str) {
        self.valid.lock().unwrap().insert(token.to_string());
    }

    fn revoke(&self, token: &str) {
        self.valid.lock().unwrap().remove(token);
    }

    fn set_version(&self, n: u32) {
        *self.version.lock().unwrap() = n;
    }

    /// The status it refuses a credential with.
    fn refusal(&self) -> u16 {
        if self.forbidden {
            403
        } else {
            401
        }
    }

    fn asked(&self, token: &str) -> usize {
        self.asked.lock().unwrap().get(token).copied().unwrap_or(0)
    }

    async fn start(&self) -> SocketAddr {
        let origin = self.clone();
        common::serve(move |req| {
            let token = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("")
                .to_string();
            *origin
                .asked
                .lock()
                .unwrap()
                .entry(token.clone())
                .or_default() += 1;
            if origin.valid.lock().unwrap().contains(&token) {
                let n = *origin.version.lock().unwrap();
                Response::builder()
                    .header("cache-control", "private")
                    .header("content-type", "text/plain")
                    .body(Full::new(Bytes::from(format!("secret v{n} for {token}"))))
                    .expect("response")
            } else {
                Response::builder()
                    .status(origin.refusal())
                    .header("www-authenticate", "Bearer error=\"invalid_token\"")
                    .header("content-type", "text/plain")
                    .body(Full::new(Bytes::from(REFUSED)))
                    .expect("response")
            }
        })
        .await
    }
}

/// A proxy for `upstream` polling every [`POLL`]; (listener, admin).
async fn proxy(upstream: SocketAddr) -> (SocketAddr, SocketAddr) {
    common::proxy_for(upstream, |c| c.poll_interval = POLL).await
}

/// Opens a subscription to `/authz` with `token` (none when empty) on a
/// raw connection; the connection and what was read so far.
async fn subscribe(proxy: SocketAddr, token: &str) -> (TcpStream, Vec<u8>) {
    let mut stream = TcpStream::connect(proxy).await.expect("connect");
    let auth = match token {
        "" => String::new(),
        t => format!("Authorization: Bearer {t}\r\n"),
    };
    let request = format!("GET /authz HTTP/1.1\r\nHost: {proxy}\r\n{auth}Subscribe: true\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    (stream, Vec::new())
}

/// Reads until the stream's last chunk (`0\r\n\r\n`) or the connection's
/// end, bounded in time; the bytes read.
async fn read_to_end_of_stream(stream: &mut TcpStream, seen: &mut Vec<u8>, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 16 * 1024];
    while !String::from_utf8_lossy(seen).contains("\r\n0\r\n\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "the stream did not end within {limit:?}; got {:?}",
            String::from_utf8_lossy(seen)
        );
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) => return,
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
            Ok(Err(_)) => return,
            Err(_) => {}
        }
    }
}

/// Reads a whole plain (non-209) answer to a subscription request: head and body.
async fn plain_answer(proxy: SocketAddr, token: &str) -> String {
    let (mut stream, mut seen) = subscribe(proxy, token).await;
    read_until(&mut stream, &mut seen, |t| {
        t.starts_with("HTTP/1.1 209") || is_whole(t)
    })
    .await;
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(
        !text.starts_with("HTTP/1.1 209"),
        "a refused credential was answered with a subscription: {text:?}"
    );
    text
}

/// Whether `text` holds a whole response: its head, and its body by
/// `Content-Length` or to the last chunk.
fn is_whole(text: &str) -> bool {
    let Some(end) = text.find("\r\n\r\n") else {
        return false;
    };
    let head = text[..end].to_ascii_lowercase();
    if head.contains("transfer-encoding: chunked") {
        return text[end..].ends_with("\r\n0\r\n\r\n");
    }
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse::<usize>().expect("length"));
    text.len() >= end + 4 + len
}

/// `/readyz` answers 200 at every look over `span`.
async fn ready_throughout(admin: SocketAddr, span: Duration) {
    let until = Instant::now() + span;
    while Instant::now() < until {
        let answer = common::get(admin, "/readyz", &[]).await;
        let status = answer.status();
        let reason = common::body_of(answer).await;
        assert_eq!(
            status,
            200,
            "/readyz turned red: {}",
            String::from_utf8_lossy(&reason)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a subscriber whose credential expires mid-stream is sent: the
/// origin's 401 or 403 (status line, `WWW-Authenticate`, its body) as an update,
/// promptly, and then the end of its stream.
async fn expiry_reaches_the_subscriber(origin: &Origin, front: SocketAddr) {
    let (mut stream, mut seen) = subscribe(front, "tokenA").await;
    read_until(&mut stream, &mut seen, |t| {
        t.contains("secret v1 for tokenA")
    })
    .await;
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 209"));
    origin.revoke("tokenA");
    let revoked = Instant::now();
    read_until(&mut stream, &mut seen, |t| t.contains(REFUSED)).await;
    let told_in = revoked.elapsed();
    assert!(
        told_in < POLL * 5,
        "the subscriber was told of the 401 after {told_in:?}"
    );
    read_to_end_of_stream(&mut stream, &mut seen, Duration::from_secs(5)).await;
    let body = String::from_utf8_lossy(&dechunk(&seen)).to_string();
    let status_line = match origin.refusal() {
        401 => "HTTP/1.1 401 Unauthorized",
        _ => "HTTP/1.1 403 Forbidden",
    };
    let denial = &body[body.find(status_line).expect("a 401 or 403 update")..];
    assert!(
        denial.contains("www-authenticate: Bearer error=\"invalid_token\""),
        "{denial:?}"
    );
    assert!(denial.contains(&format!("Content-Length: {}", REFUSED.len())));
    assert!(denial.contains(REFUSED));
    // Nothing after the denial: it is the stream's last update.
    assert_eq!(denial.matches("Version:").count(), 1, "{denial:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_mid_stream_sends_the_401_and_ends_the_stream() {
    let origin = Origin::default();
    origin.allow("tokenA");
    origin.set_version(1);
    let (front, admin) = proxy(origin.start().await).await;
    expiry_reaches_the_subscriber(&origin, front).await;
    // The proxy stops asking the origin with the dead credential.
    let asked = origin.asked("tokenA");
    tokio::time::sleep(POLL * 6).await;
    assert!(
        origin.asked("tokenA") <= asked + 1,
        "the proxy went on polling with a refused credential: {} requests after the 401",
        origin.asked("tokenA") - asked
    );
    // A new subscription with it gets the origin's 401, not a 209 that
    // would end at once (braid-http's retry would reconnect for ever).
    let again = plain_answer(front, "tokenA").await;
    assert!(again.starts_with("HTTP/1.1 401"), "{again:?}");
    assert!(again.contains(REFUSED), "{again:?}");
    assert!(!again.contains("secret"), "{again:?}");
    ready_throughout(admin, Duration::from_secs(4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_mid_stream_at_an_edge_sends_the_403_and_ends_the_stream() {
    let origin = Origin {
        forbidden: true,
        ..Origin::default()
    };
    origin.allow("tokenA");
    origin.set_version(1);
    let (first, first_admin) = proxy(origin.start().await).await;
    let (edge, edge_admin) = proxy(first).await;
    expiry_reaches_the_subscriber(&origin, edge).await;
    let again = plain_answer(edge, "tokenA").await;
    assert!(again.starts_with("HTTP/1.1 403"), "{again:?}");
    assert!(again.contains(REFUSED), "{again:?}");
    ready_throughout(edge_admin, Duration::from_secs(4)).await;
    ready_throughout(first_admin, Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_stays_200_when_a_hundred_credentials_expire() {
    const N: usize = 100;
    let origin = Origin::default();
    origin.set_version(1);
    let tokens: Vec<String> = (0..N).map(|i| format!("token{i:03}")).collect();
    for token in &tokens {
        origin.allow(token);
    }
    let (front, admin) = proxy(origin.start().await).await;
    let mut streams = Vec::new();
    for token in &tokens {
        let (mut stream, mut seen) = subscribe(front, token).await;
        read_until(&mut stream, &mut seen, |t| {
            t.contains(&format!("secret v1 for {token}"))
        })
        .await;
        streams.push((stream, seen));
    }
    for token in &tokens {
        origin.revoke(token);
    }
    // Longer than the staleness limit (three poll intervals, at least 3 s).
    ready_throughout(admin, Duration::from_secs(4)).await;
    for ((stream, seen), token) in streams.iter_mut().zip(&tokens) {
        read_until(stream, seen, |t| t.contains(REFUSED)).await;
        read_to_end_of_stream(stream, seen, Duration::from_secs(5)).await;
        let text = String::from_utf8_lossy(seen);
        assert!(text.contains("HTTP/1.1 401"), "{token}: {text:?}");
        // Each stream carried its own credential's document only.
        assert_eq!(
            text.matches("secret v1 for").count(),
            1,
            "{token}: {text:?}"
        );
    }
    // Each credential was refused once, then never asked with again.
    let asked: usize = tokens.iter().map(|t| origin.asked(t)).sum();
    tokio::time::sleep(POLL * 4).await;
    let later: usize = tokens.iter().map(|t| origin.asked(t)).sum();
    assert_eq!(
        later, asked,
        "the proxy went on polling with refused credentials"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_credentials_subscriber_is_unaffected_and_a_new_one_gets_the_current_document() {
    let origin = Origin::default();
    origin.allow("tokenA");
    origin.allow("tokenB");
    origin.set_version(1);
    let (front, admin) = proxy(origin.start().await).await;
    let (mut b, mut b_seen) = subscribe(front, "tokenB").await;
    read_until(&mut b, &mut b_seen, |t| t.contains("secret v1 for tokenB")).await;
    let (mut a, mut a_seen) = subscribe(front, "tokenA").await;
    read_until(&mut a, &mut a_seen, |t| t.contains("secret v1 for tokenA")).await;
    origin.revoke("tokenA");
    read_until(&mut a, &mut a_seen, |t| t.contains(REFUSED)).await;
    read_to_end_of_stream(&mut a, &mut a_seen, Duration::from_secs(5)).await;
    // Anonymous: the origin's 401, never tokenA's (or tokenB's) state.
    let anonymous = plain_answer(front, "").await;
    assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous:?}");
    assert!(!anonymous.contains("secret"), "{anonymous:?}");
    // tokenB still follows its document.
    origin.set_version(2);
    common::wire::versions_until(&mut b, &mut b_seen, 2).await;
    let b_text = String::from_utf8_lossy(&dechunk(&b_seen)).to_string();
    assert!(!b_text.contains("tokenA"), "{b_text:?}");
    assert!(!b_text.contains("401"), "{b_text:?}");
    assert!(!b_text.contains(REFUSED), "{b_text:?}");
    // A later valid credential subscribes as usual and gets the current document.
    origin.allow("tokenC");
    let (mut c, mut c_seen) = subscribe(front, "tokenC").await;
    read_until(&mut c, &mut c_seen, |t| t.contains("secret v2 for tokenC")).await;
    let c_text = String::from_utf8_lossy(&c_seen).to_string();
    assert!(c_text.starts_with("HTTP/1.1 209"), "{c_text:?}");
    assert!(!c_text.contains("tokenA") && !c_text.contains("tokenB"));
    // And tokenA, valid again, subscribes afresh.
    origin.allow("tokenA");
    let (mut a2, mut a2_seen) = subscribe(front, "tokenA").await;
    read_until(&mut a2, &mut a2_seen, |t| {
        t.contains("secret v2 for tokenA")
    })
    .await;
    ready_throughout(admin, Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_origin_refusing_the_first_subscription_is_answered_with_its_401() {
    // `--upstream-kind rest`: the proxy polls for the first state itself.
    let origin = Origin::default();
    origin.set_version(1);
    let (front, admin) = common::proxy_for(origin.start().await, |c| {
        c.poll_interval = POLL;
        c.upstream_kind = braid_proxy::config::UpstreamKind::Rest;
    })
    .await;
    let refused = plain_answer(front, "tokenA").await;
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused:?}");
    assert!(refused.contains(REFUSED), "{refused:?}");
    assert!(
        refused.contains("www-authenticate: Bearer error=\"invalid_token\""),
        "{refused:?}"
    );
    origin.allow("tokenA");
    let (mut a, mut seen) = subscribe(front, "tokenA").await;
    read_until(&mut a, &mut seen, |t| t.contains("secret v1 for tokenA")).await;
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 209"));
    ready_throughout(admin, Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_counts_a_4xx_as_an_answer_and_a_5xx_as_none() {
    use std::sync::atomic::{AtomicU16, Ordering::Relaxed};
    let status = Arc::new(AtomicU16::new(200));
    let answer = status.clone();
    let origin = common::serve(move |_req| {
        let status = answer.load(Relaxed);
        Response::builder()
            .status(status)
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from(format!("answered {status}"))))
            .expect("response")
    })
    .await;
    let (front, admin) = proxy(origin).await;
    let (mut sub, mut seen) = subscribe(front, "").await;
    read_until(&mut sub, &mut seen, |t| t.contains("answered 200")).await;
    // Answers about the request, not failures of the upstream.
    status.store(429, Relaxed);
    ready_throughout(admin, Duration::from_secs(4)).await;
    // The upstream failing: red within the limit (3 s) plus the watcher's
    // backoff since the 429s (bounded by the wait).
    status.store(503, Relaxed);
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let answer = common::get(admin, "/readyz", &[]).await;
        if answer.status() == 503 {
            let reason = common::body_of(answer).await;
            assert!(
                String::from_utf8_lossy(&reason).contains("without an answer from the upstream"),
                "{reason:?}"
            );
            break;
        }
        assert!(
            Instant::now() < until,
            "/readyz stayed 200 with the origin answering 503"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(sub);
}
