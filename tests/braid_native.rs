//! Braid-native by default (issue 45): a Braid server is recognized on
//! sight (a 209, a Braid header, or braidify's marks on a plain GET), and
//! answers to GETs that named a `Version` or `Parents` are versions, stored
//! under what they named, never the present. Real sockets, default flags.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

/// A Braid origin at version 3 that answers every version it has: a GET
/// naming `Version: "N"` gets version N (and says so); `Parents` alone gets
/// the current version; every answer is fresh for a long time. Counts the
/// requests it saw by their `Version`/`Parents` (and `status` answers 309
/// for a version it never had).
struct Versions {
    seen: Arc<Mutex<Vec<String>>>,
}

impl Versions {
    async fn start(vary: bool) -> (std::net::SocketAddr, Versions) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let addr = common::serve(move |req: Request<Incoming>| {
            let named = |name: &str| common::header_text(req.headers(), name);
            let (version, parents) = (named("version"), named("parents"));
            log.lock().unwrap().push(format!(
                "{} {}",
                version.as_deref().unwrap_or("-"),
                parents.as_deref().unwrap_or("-")
            ));
            let n = match version.as_deref() {
                None => 3,
                Some(v) => match v.trim_matches('"').parse::<u32>() {
                    Ok(n) if (1..=3).contains(&n) => n,
                    _ => 0,
                },
            };
            let mut answer = Response::builder()
                .header("cache-control", "max-age=100000")
                .header("content-type", "text/plain");
            if vary {
                answer = answer.header("vary", "Version, Parents");
            }
            if n == 0 {
                return answer
                    .status(309)
                    .body(Full::new(Bytes::from_static(b"version unknown here\n")))
                    .unwrap();
            }
            let body = match &parents {
                Some(p) if version.is_none() => format!("v{n} since {p}"),
                _ => format!("v{n}"),
            };
            answer
                .header("version", format!("\"{n}\""))
                .header("current-version", "\"3\"")
                .body(Full::new(Bytes::from(body)))
                .unwrap()
        })
        .await;
        (addr, Versions { seen })
    }

    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

async fn text(response: Response<Incoming>) -> (u16, Option<String>, String) {
    let status = response.status().as_u16();
    let version = response
        .headers()
        .get("version")
        .map(|v| v.to_str().unwrap().to_string());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, version, String::from_utf8_lossy(&body).into_owned())
}

/// Versions 2, 3 and an old 1 (with `Parents`) asked for by name do not
/// become the present: the next plain GET is version 3. Each is stored
/// side by side under what it named and reused while fresh, with or
/// without the origin saying `Vary: Version, Parents`.
#[tokio::test]
async fn versioned_gets_are_stored_as_versions_not_as_the_present() {
    for vary in [false, true] {
        let (origin, versions) = Versions::start(vary).await;
        let (proxy, _) = common::proxy_for(origin, |_| ()).await;
        let asks: [&[(&str, &str)]; 4] = [
            &[("version", "\"2\"")],
            &[("version", "\"3\"")],
            &[("version", "\"1\""), ("parents", "\"0\"")],
            &[("parents", "\"1\"")],
        ];
        let wants = ["v2", "v3", "v1", "v3 since \"1\""];
        for (ask, want) in asks.iter().zip(wants) {
            let (status, _, body) = text(common::get(proxy, "/doc", ask).await).await;
            assert_eq!((status, body.as_str()), (200, want), "vary={vary} {ask:?}");
        }
        assert_eq!(versions.count(), 4, "vary={vary}");
        let (status, version, body) = text(common::get(proxy, "/doc", &[]).await).await;
        assert_eq!(
            (status, version.as_deref(), body.as_str()),
            (200, Some("\"3\""), "v3"),
            "vary={vary}: a plain GET after versioned ones is the present"
        );
        let before = versions.count();
        for (ask, want) in asks.iter().zip(wants) {
            let (status, _, body) = text(common::get(proxy, "/doc", ask).await).await;
            assert_eq!((status, body.as_str()), (200, want), "vary={vary} {ask:?}");
        }
        let (_, version, body) = text(common::get(proxy, "/doc", &[]).await).await;
        assert_eq!((version.as_deref(), body.as_str()), (Some("\"3\""), "v3"));
        assert_eq!(
            versions.count(),
            before,
            "vary={vary}: fresh versioned answers are reused ({:?})",
            versions.seen.lock().unwrap()
        );
    }
}

/// A GET answered with the version old first, then the present: each
/// stays what it is (the order of asking does not matter).
#[tokio::test]
async fn an_old_version_asked_after_the_present_leaves_the_present() {
    let (origin, versions) = Versions::start(false).await;
    let (proxy, _) = common::proxy_for(origin, |_| ()).await;
    let (_, version, body) = text(common::get(proxy, "/doc", &[]).await).await;
    assert_eq!((version.as_deref(), body.as_str()), (Some("\"3\""), "v3"));
    let old = [("version", "\"1\""), ("parents", "\"0\"")];
    let (_, version, body) = text(common::get(proxy, "/doc", &old).await).await;
    assert_eq!((version.as_deref(), body.as_str()), (Some("\"1\""), "v1"));
    let (_, version, body) = text(common::get(proxy, "/doc", &[]).await).await;
    assert_eq!((version.as_deref(), body.as_str()), (Some("\"3\""), "v3"));
    let (_, _, body) = text(common::get(proxy, "/doc", &old).await).await;
    assert_eq!(body, "v1");
    assert_eq!(versions.count(), 2, "{:?}", versions.seen.lock().unwrap());
}

/// An answer saying the version is unknown here (309) is never reused,
/// fresh as it may say it is.
#[tokio::test]
async fn version_unknown_here_is_never_reused() {
    let (origin, versions) = Versions::start(false).await;
    let (proxy, _) = common::proxy_for(origin, |_| ()).await;
    for _ in 0..2 {
        let (status, _, _) = text(common::get(proxy, "/doc", &[("version", "\"9\"")]).await).await;
        assert_eq!(status, 309);
    }
    assert_eq!(versions.count(), 2);
}

/// What a braidify origin's handlers send when they answer as a plain
/// origin would: nothing Braid but braidify's own marks.
struct Braidify {
    puts: Arc<AtomicUsize>,
}

impl Braidify {
    async fn start() -> (std::net::SocketAddr, Braidify) {
        let puts = Arc::new(AtomicUsize::new(0));
        let counted = puts.clone();
        let addr = common::serve(move |req: Request<Incoming>| {
            let answer = Response::builder()
                .header("range-request-allow-methods", "PATCH, PUT")
                .header("range-request-allow-units", "json")
                .header("vary", "Version")
                .header("vary", "Parents")
                .header("vary", "Subscribe")
                .header("content-type", "application/json");
            if req.method() == http::Method::PUT {
                counted.fetch_add(1, Ordering::SeqCst);
                return answer.status(200).body(Full::new(Bytes::new())).unwrap();
            }
            answer
                .body(Full::new(Bytes::from_static(b"{\"a\":1}")))
                .unwrap()
        })
        .await;
        (addr, Braidify { puts })
    }
}

/// A patch PUT (`Content-Range`, no `Parents`) to a braidify origin whose
/// GETs carry only its marks: forwarded to it (it applies its patches),
/// not refused with 428 — whether a GET came first or not.
#[tokio::test]
async fn braidify_marks_make_patch_puts_go_to_the_origin() {
    let (origin, braidify) = Braidify::start().await;
    let (proxy, _) = common::proxy_for(origin, |_| ()).await;
    let patch = [("content-range", "json .a"), ("content-length", "0")];
    let response = common::request(proxy, "PUT", "/fresh", &patch).await;
    assert_eq!(response.status().as_u16(), 200, "a first patch PUT");
    assert_eq!(braidify.puts.load(Ordering::SeqCst), 1);
    let (status, _, _) = text(common::get(proxy, "/doc", &[]).await).await;
    assert_eq!(status, 200);
    let response = common::request(proxy, "PUT", "/doc", &patch).await;
    assert_eq!(response.status().as_u16(), 200, "a patch PUT after a GET");
    assert_eq!(braidify.puts.load(Ordering::SeqCst), 2);
}

/// A braidify origin's plain GET answers pass without a `Version` of the
/// proxy's own; a plain origin's (even one that says `Vary`) get one.
#[tokio::test]
async fn braidify_marks_keep_the_proxy_s_version_off_and_plain_stays_plain() {
    let (origin, _) = Braidify::start().await;
    let (proxy, _) = common::proxy_for(origin, |_| ()).await;
    for _ in 0..2 {
        let response = common::get(proxy, "/doc", &[]).await;
        assert!(response.headers().get("version").is_none());
        assert!(response.headers().get("current-version").is_none());
        let (status, _, body) = text(response).await;
        assert_eq!((status, body.as_str()), (200, "{\"a\":1}"));
    }
    let plain = common::serve(|_| {
        Response::builder()
            .header("vary", "Accept")
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(b"plain")))
            .unwrap()
    })
    .await;
    let (proxy, _) = common::proxy_for(plain, |_| ()).await;
    let (_, version, body) = text(common::get(proxy, "/doc", &[]).await).await;
    assert_eq!(body, "plain");
    assert!(
        version.is_some(),
        "a plain origin's GET gets the proxy's Version"
    );
}

/// braid-http's suite mounts handlers that only parse updates: a GET to
/// them never answers. A patch PUT as the first request to such a
/// resource, in a directory whose every answer so far carried braidify's
/// `Range-Request-Allow-Methods: PATCH, PUT`, goes to the origin without
/// a GET first; in a directory where one answer lacked it, the proxy
/// still asks (and a plain origin's resource is written by the proxy).
#[tokio::test]
async fn a_directory_that_declares_range_writes_gets_patch_puts_without_a_probe() {
    let gets = Arc::new(AtomicUsize::new(0));
    let puts = Arc::new(AtomicUsize::new(0));
    let (g, p) = (gets.clone(), puts.clone());
    let origin = common::serve_async(move |req: Request<Incoming>| {
        let (g, p) = (g.clone(), p.clone());
        async move {
            let path = req.uri().path().to_string();
            let mut answer = Response::builder().header("content-type", "text/plain");
            if !path.starts_with("/plain/") {
                answer = answer.header("range-request-allow-methods", "PATCH, PUT");
            }
            if req.method() == http::Method::PUT {
                p.fetch_add(1, Ordering::SeqCst);
                return answer
                    .body(Full::new(Bytes::from_static(b"applied")))
                    .unwrap();
            }
            g.fetch_add(1, Ordering::SeqCst);
            if path.contains("/parse-only") {
                // A handler that only parses updates: no answer to a GET.
                tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            }
            answer.body(Full::new(Bytes::from_static(b"doc"))).unwrap()
        }
    })
    .await;
    let (proxy, _) = common::proxy_for(origin, |_| ()).await;
    // What the directory said so far: two answers, both declaring.
    for path in ["/h/a", "/h/b"] {
        let (status, _, _) = text(common::get(proxy, path, &[]).await).await;
        assert_eq!(status, 200);
    }
    let before = gets.load(Ordering::SeqCst);
    let patch = [("content-range", "text [0:0]"), ("content-length", "0")];
    let response = common::request(proxy, "PUT", "/h/parse-only", &patch).await;
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(puts.load(Ordering::SeqCst), 1, "the origin applies it");
    assert_eq!(gets.load(Ordering::SeqCst), before, "no GET first");
    // A directory with an answer that did not declare it: the proxy asks.
    let (status, _, _) = text(common::get(proxy, "/plain/a", &[]).await).await;
    assert_eq!(status, 200);
    let gets_before = gets.load(Ordering::SeqCst);
    let response = common::request(
        proxy,
        "PUT",
        "/plain/b",
        &[("content-range", "text [0:0]"), ("content-length", "0")],
    )
    .await;
    assert_ne!(response.status().as_u16(), 502);
    assert!(
        gets.load(Ordering::SeqCst) > gets_before,
        "a GET to learn the resource before a patch is applied or sent"
    );
    assert_eq!(
        puts.load(Ordering::SeqCst),
        1,
        "never a raw patch to a plain origin"
    );
}

/// The 209 head of a Braid upstream written by hand; the body runs until
/// the connection closes.
const RAW_209: &[u8] =
    b"HTTP/1.1 209 Multiresponse\r\nsubscribe: true\r\nconnection: close\r\n\r\n";

/// An upstream whose update headers cannot be read (a line with no colon,
/// as braid-http's suite writes): the subscribers of every tier get the
/// good update, then that header block as it came, as their stream's last
/// bytes, so that their client reports the upstream's parse error and does
/// not retry; nothing after the block is relayed, the block is never
/// stored, and for a while the upstream is not asked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_update_head_is_handed_on_as_the_stream_s_last_bytes_at_every_tier() {
    const GOOD: &str = "Version: \"v1\"\r\nContent-Length: 4\r\n\r\ngood\r\n";
    const BLOCK: &str = "hello: true\r\nhello\r\nContent-Length: 2\r\n\r\n";
    let asked = Arc::new(AtomicUsize::new(0));
    let count = asked.clone();
    // Written apart, as braid-http's server writes it (one write per line):
    // the block must be handed on whole, whatever the reads.
    let upstream = common::wire::raw_upstream_in_parts(
        move |_| {
            count.fetch_add(1, Ordering::SeqCst);
            vec![
                [RAW_209, GOOD.as_bytes()].concat(),
                b"hello: true\r\n".to_vec(),
                b"hello\r\n".to_vec(),
                b"Content-Length: 2\r\n\r\n".to_vec(),
                b"hi".to_vec(),
            ]
        },
        std::time::Duration::from_millis(30),
    )
    .await;
    let (tier1, _) = common::proxy_for(upstream, |_| ()).await;
    let (edge, _) = common::proxy_for(tier1, |_| ()).await;
    for (name, addr, path) in [("first tier", tier1, "/a"), ("edge", edge, "/b")] {
        let (mut stream, head) = common::wire::subscribe_raw(addr, path).await;
        assert!(head.starts_with("HTTP/1.1 209"), "{name}: {head}");
        let body = common::wire::unchunk(&common::wire::rest_of(&mut stream).await);
        let body = String::from_utf8_lossy(&body).into_owned();
        let at = body
            .find("good")
            .unwrap_or_else(|| panic!("{name}: no good update: {body:?}"));
        assert!(
            body[at..]
                .trim_start_matches("good")
                .trim_start_matches("\r\n")
                .starts_with(BLOCK),
            "{name}: the block, whole, after the good update: {body:?}"
        );
        assert!(
            body.ends_with(BLOCK),
            "{name}: and nothing after it: {body:?}"
        );
        // A later subscriber is told to come back later, in one line.
        let (mut later, head) = common::wire::subscribe_raw(addr, path).await;
        assert!(head.starts_with("HTTP/1.1 502"), "{name}: {head}");
        assert!(
            head.to_ascii_lowercase().contains("retry-after:"),
            "{name}: {head}"
        );
        let text = String::from_utf8_lossy(&common::wire::rest_of(&mut later).await).into_owned();
        assert!(
            !text.contains("hello"),
            "{name}: the block is not stored: {text}"
        );
    }
    assert_eq!(
        asked.load(Ordering::SeqCst),
        2,
        "the upstream asked once per path"
    );
}

/// An update that carries only an error status (braid-http's
/// `sendUpdate({status: 403})`) is news among the updates, not a version:
/// a subscriber behind it gets it as it came (it is not collapsed away),
/// and the model keeps the version before it, so a GET answered from the
/// live feed still has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_stream_error_status_reaches_every_subscriber_and_is_not_a_version() {
    const V1: &str = "HTTP 200 OK\r\nVersion: \"v1\"\r\nContent-Length: 5\r\n\r\nhello\r\n\r\n";
    const FORBIDDEN: &str = "HTTP 403 Forbidden\r\nContent-Length: 5\r\n\r\nuh oh\r\n\r\n";
    const V2: &str = "HTTP 200 OK\r\nVersion: \"v2\"\r\nParents: \"v1\"\r\nContent-Range: text [5:5]\r\nContent-Length: 11\r\n\r\n still here\r\n\r\n";
    let upstream = common::wire::raw_upstream_in_parts(
        |_| {
            vec![
                [RAW_209, V1.as_bytes()].concat(),
                FORBIDDEN.into(),
                V2.into(),
            ]
        },
        std::time::Duration::from_millis(100),
    )
    .await;
    let (proxy, _) = common::proxy_for(upstream, |_| ()).await;
    let (mut first, head) = common::wire::subscribe_raw(proxy, "/s").await;
    assert!(head.starts_with("HTTP/1.1 209"), "{head}");
    let mut seen = Vec::new();
    common::wire::read_until(&mut first, &mut seen, |s| s.contains("still here")).await;
    // Joins after all three: it starts where the session started and is
    // more than one announcement behind, the case a collapse would serve.
    let (mut second, head) = common::wire::subscribe_raw(proxy, "/s").await;
    assert!(head.starts_with("HTTP/1.1 209"), "{head}");
    let mut late = Vec::new();
    common::wire::read_until(&mut second, &mut late, |s| s.contains("still here")).await;
    for (who, bytes) in [("first", &seen), ("late", &late)] {
        let text = String::from_utf8_lossy(&common::wire::unchunk(bytes)).into_owned();
        let order: Vec<usize> = ["hello", "HTTP 403 Forbidden", "uh oh", "still here"]
            .iter()
            .map(|part| {
                text.find(part)
                    .unwrap_or_else(|| panic!("{who}: no {part:?} in {text:?}"))
            })
            .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "{who}: in order: {text:?}"
        );
    }
    // The patch after the 403 applied to the version before it: a GET of
    // v2 is answered from the live feed (had the 403 cost the model, it
    // would go to the upstream, whose answer to anything is a stream).
    let answered = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        text(common::get(proxy, "/s", &[("host", "x")]).await).await
    })
    .await
    .expect("answered from the live feed, not the upstream");
    assert_eq!(
        answered,
        (200, Some("\"v2\"".into()), "hello still here".into())
    );
}
