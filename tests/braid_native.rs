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
