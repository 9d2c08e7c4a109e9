//! Braid patch writes (issue 22) against real origins on 127.0.0.1:0: the
//! proxy applies a `PUT` with patches to the current document and writes
//! the whole body back under `If-Match`, subscribers get the writer's
//! patches, conflicts get 409 and bad patches are refused without a PUT
//! reaching the origin. A Braid upstream gets the patches as they are.
//!
//! Sections: `support` (the origin, the proxy, clients, a subscriber),
//! then the tests, then a property test of random concurrent edits.

mod common;

mod support {
    use std::collections::HashMap;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime};

    use braid_proxy::braid::{self, DecodeLimits, Decoder, Update, VersionList};
    use braid_proxy::config::Config;
    use bytes::Bytes;
    use http::{HeaderMap, Method, Request, Response, StatusCode};
    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpStream;
    use tokio::sync::mpsc;

    pub const WAIT: Duration = Duration::from_secs(5);

    /// Awaits `fut`, failing the test if it takes longer than [`WAIT`].
    pub async fn within<F: std::future::Future>(what: &str, fut: F) -> F::Output {
        match tokio::time::timeout(WAIT, fut).await {
            Ok(output) => output,
            Err(_) => panic!("timed out after {WAIT:?}: {what}"),
        }
    }

    /// Which validators the origin gives.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum Validators {
        /// A strong ETag `"eN"`, also in PUT answers.
        ETag,
        /// A strong ETag in GET answers only; PUT answers carry none.
        ETagOnGet,
        /// Only `Last-Modified`.
        LastModified,
        None,
    }

    struct Doc {
        body: Bytes,
        n: u64,
        modified: SystemTime,
    }

    /// A plain REST origin: path → document. PUT stores the body it is sent
    /// (honouring `If-Match` and `If-Unmodified-Since`); every PUT is counted
    /// and every request head recorded.
    #[derive(Clone)]
    pub struct Origin {
        docs: Arc<Mutex<HashMap<String, Doc>>>,
        counter: Arc<AtomicUsize>,
        pub validators: Validators,
        /// PUTs received, whatever the answer.
        pub puts: Arc<AtomicUsize>,
        /// Bodies of the PUTs accepted, in order.
        pub accepted: Arc<Mutex<Vec<Bytes>>>,
        /// The heads of the PUTs received.
        pub put_heads: Arc<Mutex<Vec<HeaderMap>>>,
        /// When set, the next PUT finds the document changed by someone else first.
        pub race_next_put: Arc<AtomicBool>,
    }

    impl Origin {
        pub fn new(validators: Validators) -> Origin {
            Origin {
                docs: Arc::default(),
                counter: Arc::default(),
                validators,
                puts: Arc::default(),
                accepted: Arc::default(),
                put_heads: Arc::default(),
                race_next_put: Arc::default(),
            }
        }

        /// Stores a document directly (not through the proxy); returns its ETag value.
        pub fn set(&self, path: &str, body: impl Into<Bytes>) -> String {
            let n = self.counter.fetch_add(1, Ordering::SeqCst) as u64 + 1;
            // Whole seconds, as Last-Modified carries them; every change a second apart.
            let modified = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + n);
            self.docs.lock().expect("lock").insert(
                path.to_string(),
                Doc {
                    body: body.into(),
                    n,
                    modified,
                },
            );
            format!("e{n}")
        }

        pub fn body(&self, path: &str) -> String {
            let docs = self.docs.lock().expect("lock");
            String::from_utf8(docs[path].body.to_vec()).expect("utf-8")
        }

        pub fn puts(&self) -> usize {
            self.puts.load(Ordering::SeqCst)
        }

        pub async fn start(&self) -> SocketAddr {
            let origin = self.clone();
            crate::common::serve_async(move |req| {
                let origin = origin.clone();
                async move { origin.answer(req).await }
            })
            .await
        }

        fn validator_headers(&self, doc: &Doc, on_put: bool) -> Vec<(&'static str, String)> {
            let etag = format!("\"e{}\"", doc.n);
            match self.validators {
                Validators::ETag => vec![("etag", etag)],
                Validators::ETagOnGet if !on_put => vec![("etag", etag)],
                Validators::LastModified => {
                    vec![("last-modified", httpdate::fmt_http_date(doc.modified))]
                }
                _ => vec![],
            }
        }

        async fn answer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
            let path = req.uri().path().to_string();
            if req.method() == Method::PUT {
                return self.put(req, &path).await;
            }
            let docs = self.docs.lock().expect("lock");
            let Some(doc) = docs.get(&path) else {
                return reply(404, vec![], Bytes::new());
            };
            let headers = self.validator_headers(doc, false);
            let inm = req
                .headers()
                .get("if-none-match")
                .and_then(|v| v.to_str().ok());
            if self.validators != Validators::LastModified
                && self.validators != Validators::None
                && inm == Some(&format!("\"e{}\"", doc.n))
            {
                return reply(304, headers, Bytes::new());
            }
            let mut headers = headers;
            headers.push(("content-type", "text/plain; charset=utf-8".into()));
            reply(200, headers, doc.body.clone())
        }

        async fn put(&self, req: Request<Incoming>, path: &str) -> Response<Full<Bytes>> {
            self.puts.fetch_add(1, Ordering::SeqCst);
            self.put_heads
                .lock()
                .expect("lock")
                .push(req.headers().clone());
            let (parts, body) = req.into_parts();
            let body = body.collect().await.expect("PUT body").to_bytes();
            if self.race_next_put.swap(false, Ordering::SeqCst) {
                self.set(path, "somebody else's document\n");
            }
            let docs = self.docs.lock().expect("lock");
            if let Some(doc) = docs.get(path) {
                let if_match = parts.headers.get("if-match").and_then(|v| v.to_str().ok());
                if if_match.is_some_and(|t| t != format!("\"e{}\"", doc.n)) {
                    return reply(412, vec![], Bytes::new());
                }
                let ius = parts
                    .headers
                    .get("if-unmodified-since")
                    .and_then(|v| v.to_str().ok())
                    .map(|d| httpdate::parse_http_date(d).expect("a valid date"));
                if ius.is_some_and(|since| doc.modified > since) {
                    return reply(412, vec![], Bytes::new());
                }
            }
            drop(docs);
            self.set(path, body.clone());
            self.accepted.lock().expect("lock").push(body);
            let docs = self.docs.lock().expect("lock");
            reply(200, self.validator_headers(&docs[path], true), Bytes::new())
        }
    }

    fn reply(
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Bytes,
    ) -> Response<Full<Bytes>> {
        let mut builder = Response::builder().status(status);
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        builder.body(Full::new(body)).expect("response")
    }

    /// A proxy in front of `origin`, polling rarely: changes reach it by
    /// its own writes, write-through, refresh, or a patch write's own GET.
    pub struct Proxy {
        pub addr: SocketAddr,
        pub admin: SocketAddr,
    }

    pub async fn proxy(origin: SocketAddr, tune: impl FnOnce(&mut Config)) -> Proxy {
        let (addr, admin) = crate::common::proxy_for(origin, |config| {
            config.heartbeat = Duration::ZERO;
            config.proxy_id = "writes-test".into();
            tune(config);
        })
        .await;
        Proxy { addr, admin }
    }

    /// A complete answer.
    pub struct Answer {
        pub status: StatusCode,
        pub headers: HeaderMap,
        pub body: Bytes,
    }

    impl Answer {
        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers.get(name).and_then(|v| v.to_str().ok())
        }

        pub fn text(&self) -> String {
            String::from_utf8_lossy(&self.body).into_owned()
        }
    }

    /// Sends one request on a new connection and reads the whole answer.
    pub async fn send(
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        let response = open(addr, method, path, headers, body.into()).await;
        let (parts, body) = response.into_parts();
        let body = within("response body", body.collect())
            .await
            .expect("body")
            .to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    async fn open(
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Response<Incoming> {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string());
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(body)).expect("request");
        within(&format!("{method} {path}"), sender.send_request(req))
            .await
            .expect("response")
    }

    /// A PUT of patches in braid-http's framing: one patch as
    /// `Content-Range` + body, several as `Patches: N` and the blocks
    /// braid-http writes (`content-length`, `content-range`, blank line,
    /// content, CRLF, CRLF between patches).
    pub async fn put_patches(
        addr: SocketAddr,
        path: &str,
        version: Option<&str>,
        parents: &str,
        patches: &[(&str, &str, &str)],
    ) -> Answer {
        let version = version.map(|v| format!("\"{v}\""));
        let parents = format!("\"{parents}\"");
        let mut headers = vec![("parents", parents.as_str())];
        if let Some(v) = &version {
            headers.push(("version", v.as_str()));
        }
        let (range, count);
        let body = if let [(unit, r, content)] = patches {
            range = format!("{unit} {r}");
            headers.push(("content-range", range.as_str()));
            content.to_string()
        } else {
            count = patches.len().to_string();
            headers.push(("patches", count.as_str()));
            braid_http_patches(patches)
        };
        send(addr, "PUT", path, &headers, body).await
    }

    /// The body braid-http 1.3.80 sends for several patches.
    pub fn braid_http_patches(patches: &[(&str, &str, &str)]) -> String {
        let mut body = String::new();
        for (i, (unit, range, content)) in patches.iter().enumerate() {
            if i > 0 {
                body.push_str("\r\n");
            }
            body.push_str(&format!(
                "content-length: {}\r\ncontent-range: {unit} {range}\r\n\r\n{content}\r\n",
                content.len()
            ));
        }
        body
    }

    /// A subscriber over a real socket, decoding its stream with the crate's codec.
    pub struct Subscriber {
        updates: mpsc::Receiver<Update>,
        pub body: Vec<u8>,
        pub version: VersionList,
        pub seen: Vec<Update>,
    }

    impl Subscriber {
        pub async fn open(addr: SocketAddr, path: &str) -> Subscriber {
            let response = open(addr, "GET", path, &[("subscribe", "true")], Bytes::new()).await;
            assert_eq!(response.status().as_u16(), 209, "a subscription");
            let (tx, updates) = mpsc::channel(64);
            let mut body = response.into_body();
            tokio::spawn(async move {
                let mut decoder = Decoder::new(DecodeLimits::default());
                while let Some(Ok(frame)) = body.frame().await {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    decoder.push(&data);
                    while let Some(update) = decoder.next_update().expect("a valid stream") {
                        if tx.send(update).await.is_err() {
                            return;
                        }
                    }
                }
            });
            Subscriber {
                updates,
                body: Vec::new(),
                version: VersionList::default(),
                seen: Vec::new(),
            }
        }

        /// The next update, applied to the replica.
        pub async fn next(&mut self) -> Update {
            let update = within("the next update", self.updates.recv())
                .await
                .expect("the stream stays open");
            match &update.body {
                braid::Body::Snapshot(body) => self.body = body.to_vec(),
                braid::Body::Patches(patches) => {
                    assert_eq!(update.parents, self.version, "patches apply to the replica");
                    self.body = braid::apply_patches(&self.body, patches).expect("patches apply");
                }
            }
            self.version = update.version.clone();
            self.seen.push(update.clone());
            update
        }

        /// Applies updates until the replica holds `text`.
        pub async fn until(&mut self, text: &str) {
            while self.body != text.as_bytes() {
                self.next().await;
            }
        }

        pub fn text(&self) -> String {
            String::from_utf8(self.body.clone()).expect("utf-8")
        }
    }

    /// One version id as a list.
    pub fn version(id: &str) -> VersionList {
        VersionList::parse(format!("\"{id}\"").as_bytes()).expect("a version")
    }
}

use std::sync::atomic::Ordering;

use braid_proxy::braid::{self, Patch};
use support::*;

#[tokio::test]
async fn a_patch_put_lands_as_the_whole_body_and_subscribers_get_the_patch() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "hello world");
    let p = proxy(origin.start().await, |_| {}).await;
    let mut sub = Subscriber::open(p.addr, "/doc").await;
    sub.until("hello world").await;
    assert_eq!(sub.version, version("e1"));

    let answer = put_patches(
        p.addr,
        "/doc",
        Some("w1"),
        "e1",
        &[("text", "[5:5]", ", dear")],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(origin.body("/doc"), "hello, dear world");
    // The origin got a plain whole-body PUT under If-Match.
    let head = origin.put_heads.lock().expect("lock")[0].clone();
    assert_eq!(head.get("if-match").expect("If-Match"), "\"e1\"");
    for name in ["content-range", "patches", "version", "parents"] {
        assert!(head.get(name).is_none(), "{name} reached the origin");
    }
    assert_eq!(head.get("content-length").expect("length"), "17");
    // The origin named the state with an ETag: the writer's id is kept.
    assert_eq!(answer.header("version"), Some("\"w1\""));
    assert_eq!(answer.header("current-version"), Some("\"w1\""));

    let update = sub.next().await;
    assert_eq!(update.version, version("w1"));
    assert_eq!(update.parents, version("e1"));
    assert_eq!(
        update.body,
        braid::Body::Patches(vec![Patch::text(5, 5, ", dear")]),
        "the writer's patch, not a snapshot"
    );
    assert_eq!(sub.text(), "hello, dear world");

    // Plain GETs and later writes see the writer's version.
    let get = send(p.addr, "GET", "/doc", &[], "").await;
    assert_eq!(get.text(), "hello, dear world");
    assert_eq!(get.header("version"), Some("\"w1\""));
    let answer = put_patches(
        p.addr,
        "/doc",
        Some("w2"),
        "w1",
        &[("text", "[0:1]", "J"), ("text", "[12:17]", "🌍")],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(origin.body("/doc"), "Jello, dear 🌍");
    let update = sub.next().await;
    assert_eq!(update.parents, version("w1"));
    assert_eq!(
        update.body,
        braid::Body::Patches(vec![Patch::text(0, 1, "J"), Patch::text(12, 17, "🌍")])
    );
    assert_eq!(sub.text(), origin.body("/doc"));
}

#[tokio::test]
async fn the_version_is_the_origins_when_the_writer_names_none() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "abc");
    let p = proxy(origin.start().await, |_| {}).await;
    let answer = put_patches(p.addr, "/doc", None, "e1", &[("bytes", "[3:3]", "d")]).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(origin.body("/doc"), "abcd");
    assert_eq!(answer.header("version"), Some("\"e2\""));
    assert_eq!(answer.header("current-version"), Some("\"e2\""));
}

#[tokio::test]
async fn an_etag_only_on_get_is_learned_after_the_write() {
    let origin = Origin::new(Validators::ETagOnGet);
    origin.set("/doc", "abc");
    let p = proxy(origin.start().await, |_| {}).await;
    let mut sub = Subscriber::open(p.addr, "/doc").await;
    sub.until("abc").await;
    let answer = put_patches(
        p.addr,
        "/doc",
        Some("mine"),
        "e1",
        &[("text", "[0:0]", ">")],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.header("version"), Some("\"mine\""));
    let update = sub.next().await;
    assert_eq!(update.version, version("mine"));
    assert!(matches!(update.body, braid::Body::Patches(_)));
    assert_eq!(sub.text(), ">abc");
}

#[tokio::test]
async fn last_modified_only_writes_under_if_unmodified_since() {
    let origin = Origin::new(Validators::LastModified);
    origin.set("/doc", "abc");
    let p = proxy(origin.start().await, |_| {}).await;
    let get = send(p.addr, "GET", "/doc", &[], "").await;
    let v1 = get.header("version").expect("a version").to_string();
    let parents = v1.trim_matches('"');
    let answer = put_patches(
        p.addr,
        "/doc",
        Some("w"),
        parents,
        &[("text", "[3:3]", "!")],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(origin.body("/doc"), "abc!");
    let head = origin.put_heads.lock().expect("lock")[0].clone();
    assert!(head.get("if-unmodified-since").is_some());
    assert!(head.get("if-match").is_none());
    // No ETag names the new state: its version is the proxy's content hash.
    let v2 = answer.header("version").expect("a version");
    assert!(v2.starts_with("\"h-"), "{v2}");
    assert_eq!(answer.header("current-version"), Some(v2));
}

#[tokio::test]
async fn an_origin_without_validators_gets_no_patch_writes() {
    let origin = Origin::new(Validators::None);
    origin.set("/doc", "abc");
    let p = proxy(origin.start().await, |_| {}).await;
    let get = send(p.addr, "GET", "/doc", &[], "").await;
    let v1 = get.header("version").expect("a version").to_string();
    let answer = put_patches(
        p.addr,
        "/doc",
        None,
        v1.trim_matches('"'),
        &[("text", "[0:0]", "x")],
    )
    .await;
    assert_eq!(answer.status, 428, "{}", answer.text());
    assert!(
        answer.text().contains("no ETag or Last-Modified"),
        "{}",
        answer.text()
    );
    assert_eq!(origin.puts(), 0);
    // A whole-body PUT still goes through.
    let answer = send(p.addr, "PUT", "/doc", &[], "whole").await;
    assert_eq!(answer.status, 200);
    assert_eq!(origin.body("/doc"), "whole");
}

#[tokio::test]
async fn stale_parents_are_a_conflict_and_nothing_is_written() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "one");
    let p = proxy(origin.start().await, |_| {}).await;
    let mut sub = Subscriber::open(p.addr, "/doc").await;
    sub.until("one").await;
    // The origin changes behind the proxy's back.
    origin.set("/doc", "two");
    let answer = put_patches(p.addr, "/doc", Some("w"), "e1", &[("text", "[0:0]", "x")]).await;
    assert_eq!(answer.status, 409, "{}", answer.text());
    assert_eq!(answer.header("current-version"), Some("\"e2\""));
    assert!(!answer.text().trim_end().contains('\n'), "one line");
    assert_eq!(origin.puts(), 0);
    assert_eq!(origin.body("/doc"), "two");
    // The proxy caught up on the way: the subscriber has the origin's body.
    sub.until("two").await;
    // With the current version as Parents the write goes through.
    let answer = put_patches(p.addr, "/doc", Some("w"), "e2", &[("text", "[0:0]", "x")]).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(origin.body("/doc"), "xtwo");
}

#[tokio::test]
async fn an_origin_412_is_a_conflict() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "one");
    let p = proxy(origin.start().await, |_| {}).await;
    origin.race_next_put.store(true, Ordering::SeqCst);
    let answer = put_patches(p.addr, "/doc", Some("w"), "e1", &[("text", "[0:0]", "x")]).await;
    assert_eq!(answer.status, 409, "{}", answer.text());
    assert!(answer.text().contains("412"), "{}", answer.text());
    assert_eq!(answer.header("current-version"), Some("\"e2\""));
    assert_eq!(origin.body("/doc"), "somebody else's document\n");
    assert!(origin.accepted.lock().expect("lock").is_empty());
}

#[tokio::test]
async fn concurrent_writers_on_one_parent_get_one_success() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "base");
    let p = proxy(origin.start().await, |_| {}).await;
    let mut sub = Subscriber::open(p.addr, "/doc").await;
    sub.until("base").await;
    let writers: Vec<_> = (0..6)
        .map(|i| {
            let addr = p.addr;
            tokio::spawn(async move {
                let id = format!("w{i}");
                let content = format!("[{i}]");
                let answer = put_patches(
                    addr,
                    "/doc",
                    Some(&id),
                    "e1",
                    &[("text", "[4:4]", &content)],
                )
                .await;
                (i, answer)
            })
        })
        .collect();
    let mut won = Vec::new();
    for writer in writers {
        let (i, answer) = writer.await.expect("writer");
        match answer.status.as_u16() {
            200 => won.push(i),
            409 => assert!(answer.header("current-version").is_some()),
            other => panic!("writer {i}: {other} {}", answer.text()),
        }
    }
    assert_eq!(won.len(), 1, "exactly one writer wins: {won:?}");
    let expected = format!("base[{}]", won[0]);
    assert_eq!(origin.body("/doc"), expected);
    assert_eq!(origin.accepted.lock().expect("lock").len(), 1);
    sub.until(&expected).await;
    assert_eq!(sub.version, version(&format!("w{}", won[0])));
    let metrics = send(p.admin, "GET", "/metrics", &[], "").await.text();
    for (name, want) in [("patch_writes_total", 1), ("patch_conflicts_total", 5)] {
        let line = format!("braid_proxy_{name} {want}");
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
}

/// What is wrong, the request headers, the body, the status expected.
type BadCase = (&'static str, Vec<(&'static str, String)>, String, u16);

#[tokio::test]
async fn bad_patches_are_refused_without_touching_the_origin() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "hello");
    let p = proxy(origin.start().await, |c| c.max_body_bytes = 1000).await;
    let big = "x".repeat(1001);
    let cases: Vec<BadCase> = vec![
        (
            "range past the end",
            vec![("content-range", "text [3:9]".into())],
            "x".into(),
            416,
        ),
        (
            "unknown unit",
            vec![("content-range", "lines [0:1]".into())],
            "x".into(),
            400,
        ),
        (
            "json unit",
            vec![("content-range", "json .a".into())],
            "1".into(),
            400,
        ),
        (
            "malformed range",
            vec![("content-range", "text [5]".into())],
            "x".into(),
            400,
        ),
        (
            "reversed range",
            vec![("content-range", "text [3:1]".into())],
            "x".into(),
            400,
        ),
        (
            "fewer patches than Patches",
            vec![("patches", "2".into())],
            braid_http_patches(&[("text", "[0:0]", "a")]),
            400,
        ),
        (
            "more patches than Patches",
            vec![("patches", "1".into())],
            braid_http_patches(&[("text", "[0:0]", "a"), ("text", "[1:1]", "b")]),
            400,
        ),
        (
            "malformed framing",
            vec![("patches", "1".into())],
            "no headers here\r\n\r\n".into(),
            400,
        ),
        (
            "malformed Patches",
            vec![("patches", "two".into())],
            String::new(),
            400,
        ),
        (
            "overlapping patches",
            vec![("patches", "2".into())],
            braid_http_patches(&[("text", "[0:3]", "a"), ("text", "[1:2]", "b")]),
            400,
        ),
        (
            "Content-Range and Patches",
            vec![
                ("content-range", "text [0:0]".into()),
                ("patches", "1".into()),
            ],
            braid_http_patches(&[("text", "[0:0]", "a")]),
            400,
        ),
        (
            "over max-body-bytes",
            vec![("content-range", "text [0:0]".into())],
            big,
            413,
        ),
        (
            "no Parents",
            vec![("content-range", "text [0:0]".into())],
            "x".into(),
            428,
        ),
        (
            "a +patch media type",
            vec![("content-type", "application/json+patch".into())],
            "Content-Range: json .a\r\n\r\n1".into(),
            415,
        ),
        (
            "JSON Patch by PUT",
            vec![("content-type", "application/json-patch+json".into())],
            "[]".into(),
            415,
        ),
    ];
    for (what, headers, body, status) in cases {
        let mut headers: Vec<(&str, &str)> =
            headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        if what != "no Parents" {
            headers.push(("parents", "\"e1\""));
        }
        let answer = send(p.addr, "PUT", "/doc", &headers, body).await;
        let reason = answer.text();
        assert_eq!(answer.status.as_u16(), status, "{what}: {reason}");
        assert_eq!(reason.lines().count(), 1, "{what}: one line: {reason:?}");
        assert_eq!(origin.puts(), 0, "{what}: the origin got a PUT");
    }
    assert_eq!(origin.body("/doc"), "hello");
    // A patched document over the limit is refused too.
    let near = "y".repeat(996);
    let answer = put_patches(p.addr, "/doc", None, "e1", &[("text", "[0:0]", &near)]).await;
    assert_eq!(answer.status, 413, "{}", answer.text());
    assert_eq!(origin.puts(), 0);
}

#[tokio::test]
async fn writes_without_braid_framing_pass_through() {
    let origin = Origin::new(Validators::ETag);
    origin.set("/doc", "hello");
    let p = proxy(origin.start().await, |_| {}).await;
    let mut sub = Subscriber::open(p.addr, "/doc").await;
    sub.until("hello").await;
    let answer = send(
        p.addr,
        "PUT",
        "/doc",
        &[("content-type", "text/plain")],
        "whole new",
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(origin.body("/doc"), "whole new");
    let head = origin.put_heads.lock().expect("lock")[0].clone();
    assert!(
        head.get("if-match").is_none(),
        "a whole-body PUT is forwarded as it is"
    );
    // Write-through: subscribers see it at once.
    sub.until("whole new").await;
}

mod braid_upstream {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use futures_util::StreamExt;
    use http::{HeaderMap, Method, Response};
    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Full, StreamBody};
    use hyper::body::Frame;

    use super::support::*;

    #[tokio::test]
    async fn patches_reach_a_braid_upstream_as_they_are() {
        let seen: Arc<Mutex<Vec<(HeaderMap, Bytes)>>> = Arc::default();
        let record = seen.clone();
        let origin = crate::common::serve_async(move |req| {
            let record = record.clone();
            async move {
                let subscribe = req.headers().contains_key("subscribe");
                if req.method() == Method::PUT {
                    let (parts, body) = req.into_parts();
                    let body = body.collect().await.expect("body").to_bytes();
                    record.lock().expect("lock").push((parts.headers, body));
                    return Response::new(Full::new(Bytes::new()).map_err(|e| match e {}).boxed());
                }
                if !subscribe {
                    return Response::new(
                        Full::new(Bytes::from_static(b"hello"))
                            .map_err(|e| match e {})
                            .boxed(),
                    );
                }
                let first = Bytes::from_static(
                    b"Version: \"b1\"\r\nContent-Length: 5\r\n\r\nhello\r\n\r\n",
                );
                let stream =
                    futures_util::stream::once(
                        async move { Ok::<_, Infallible>(Frame::data(first)) },
                    )
                    .chain(futures_util::stream::pending());
                let body: BoxBody<Bytes, Infallible> = BodyExt::boxed(StreamBody::new(stream));
                Response::builder().status(209).body(body).expect("209")
            }
        })
        .await;
        let p = proxy(origin, |_| {}).await;
        let mut sub = Subscriber::open(p.addr, "/doc").await;
        sub.until("hello").await;
        assert_eq!(sub.version, version("b1"));
        let answer = put_patches(p.addr, "/doc", Some("b2"), "b1", &[("text", "[5:5]", "!")]).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        let seen = seen.lock().expect("lock");
        let (headers, body) = &seen[0];
        assert_eq!(
            headers.get("content-range").expect("Content-Range"),
            "text [5:5]"
        );
        assert_eq!(headers.get("parents").expect("Parents"), "\"b1\"");
        assert_eq!(body.as_ref(), b"!");
    }
}

mod property {
    use std::collections::HashSet;
    use std::time::Duration;

    use proptest::prelude::*;

    use super::support::*;

    /// One client's edit: replace `delete` code points at `at` (both taken
    /// modulo the document) with `insert`, maybe with a second patch after it.
    #[derive(Debug, Clone)]
    struct Edit {
        client: usize,
        at: usize,
        delete: usize,
        insert: String,
        second: Option<(usize, String)>,
    }

    #[derive(Debug, Clone)]
    enum Round {
        /// Edits sent at once.
        Edits(Vec<Edit>),
        /// The origin is written directly, behind the proxy.
        Direct(String),
    }

    const CLIENTS: usize = 3;

    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-c]{0,3}",
            Just("é".to_string()),
            Just("😀".to_string()),
            Just("\n".to_string()),
        ]
    }

    fn edit() -> impl Strategy<Value = Edit> {
        (
            0..CLIENTS,
            0usize..64,
            0usize..4,
            piece(),
            proptest::option::of((0usize..64, piece())),
        )
            .prop_map(|(client, at, delete, insert, second)| Edit {
                client,
                at,
                delete,
                insert,
                second,
            })
    }

    fn round() -> impl Strategy<Value = Round> {
        prop_oneof![
            6 => proptest::collection::vec(edit(), 1..=CLIENTS).prop_map(Round::Edits),
            1 => "[x-z]{0,6}".prop_map(Round::Direct),
        ]
    }

    /// A client's view of the document: (version id, text).
    type View = (String, String);

    /// The edit as patches against `text`, and the text it makes.
    fn patches_of(edit: &Edit, text: &str) -> (Vec<(String, String)>, String) {
        let chars: Vec<char> = text.chars().collect();
        let at = edit.at % (chars.len() + 1);
        let end = (at + edit.delete).min(chars.len());
        let mut patches = vec![(format!("[{at}:{end}]"), edit.insert.clone())];
        let mut out: String = chars[..at].iter().collect();
        out.push_str(&edit.insert);
        let mut rest_from = end;
        if let Some((offset, insert)) = &edit.second {
            let at2 = end + offset % (chars.len() - end + 1);
            patches.push((format!("[{at2}:{at2}]"), insert.clone()));
            out.extend(&chars[end..at2]);
            out.push_str(insert);
            rest_from = at2;
        }
        out.extend(&chars[rest_from..]);
        (patches, out)
    }

    async fn view(p: &Proxy) -> View {
        let get = send(p.addr, "GET", "/doc", &[], "").await;
        assert_eq!(get.status, 200);
        let version = get
            .header("version")
            .expect("Version")
            .trim_matches('"')
            .to_string();
        (version, get.text())
    }

    async fn scenario(rounds: Vec<Round>) {
        let origin = Origin::new(Validators::ETag);
        origin.set("/doc", "start");
        let p = proxy(origin.start().await, |_| {}).await;
        let mut sub = Subscriber::open(p.addr, "/doc").await;
        sub.until("start").await;
        let mut views = vec![view(&p).await; CLIENTS];
        let mut written: HashSet<String> = HashSet::from(["start".to_string()]);
        let mut succeeded: Vec<String> = Vec::new();
        let mut next_id = 0;
        for round in rounds {
            let edits = match round {
                Round::Direct(text) => {
                    origin.set("/doc", text.clone());
                    written.insert(text);
                    continue;
                }
                Round::Edits(edits) => edits,
            };
            let sends = edits.iter().map(|edit| {
                let (parents, text) = views[edit.client].clone();
                let (patches, expected) = patches_of(edit, &text);
                next_id += 1;
                let id = format!("c{}-{next_id}", edit.client);
                let addr = p.addr;
                async move {
                    let patches: Vec<(&str, &str, &str)> = patches
                        .iter()
                        .map(|(r, c)| ("text", r.as_str(), c.as_str()))
                        .collect();
                    let answer = put_patches(addr, "/doc", Some(&id), &parents, &patches).await;
                    (answer, expected)
                }
            });
            let answers = futures_util::future::join_all(sends).await;
            let mut wins = 0;
            for (edit, (answer, expected)) in edits.iter().zip(answers) {
                match answer.status.as_u16() {
                    200 => {
                        wins += 1;
                        let v = answer.header("version").expect("Version");
                        views[edit.client] = (v.trim_matches('"').to_string(), expected.clone());
                        written.insert(expected.clone());
                        succeeded.push(expected);
                    }
                    409 => views[edit.client] = view(&p).await,
                    other => panic!("{other}: {}", answer.text()),
                }
            }
            assert!(wins <= 1, "two writes from one round both won");
        }
        // Every body the origin accepted is one a client computed, and the reverse.
        let mut accepted: Vec<String> = origin
            .accepted
            .lock()
            .expect("lock")
            .iter()
            .map(|b| String::from_utf8(b.to_vec()).expect("utf-8"))
            .collect();
        accepted.sort();
        succeeded.sort();
        assert_eq!(accepted, succeeded);
        let last = origin.body("/doc");
        assert!(
            written.contains(&last),
            "the origin holds a body nobody wrote: {last:?}"
        );
        // Every subscriber converges on the origin's document.
        let refresh = send(p.admin, "POST", "/refresh?path=/doc", &[], "").await;
        assert!(refresh.status.is_success());
        sub.until(&last).await;
        assert_eq!(view(&p).await.1, last);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

        #[test]
        fn random_concurrent_edits_never_lose_a_document(rounds in proptest::collection::vec(round(), 1..12)) {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(30), scenario(rounds))
                    .await
                    .expect("a case finishes within 30 s");
            });
        }
    }
}
