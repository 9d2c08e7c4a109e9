//! Faithful across tiers (issue 43): the matrix. For each rule an origin
//! gives (a custom `Vary` header, `Vary: Accept-Language`, `private`,
//! `Set-Cookie`, and the credentials `Authorization` and `Cookie`), for
//! GETs and subscriptions, opened one after another and all at once, at
//! the first tier, an edge and a third tier, with HTTP/1.1 and h2c
//! between tiers: clients with different views never see each other's,
//! and clients with the same view share one upstream request. All tiers
//! are the crate's `Server` on 127.0.0.1:0, clients hyper on real sockets.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

const WAIT: Duration = Duration::from_secs(10);

/// The rules under test; each has its own path at the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// `Vary: X-Tenant`: the body names the tenant.
    Tenant,
    /// `Vary: Accept-Language`.
    Language,
    /// `Cache-Control: private`: every answer is one client's.
    Private,
    /// `Set-Cookie`: every answer is one client's.
    SetsCookie,
    /// The request's `Authorization` selects the view (nothing said).
    Authorization,
    /// The request's `Cookie` selects the view (nothing said).
    Cookie,
}

const RULES: [Rule; 6] = [
    Rule::Tenant,
    Rule::Language,
    Rule::Private,
    Rule::SetsCookie,
    Rule::Authorization,
    Rule::Cookie,
];

impl Rule {
    fn path(self) -> &'static str {
        match self {
            Rule::Tenant => "/tenant",
            Rule::Language => "/language",
            Rule::Private => "/private",
            Rule::SetsCookie => "/sets-cookie",
            Rule::Authorization => "/authorization",
            Rule::Cookie => "/cookie",
        }
    }

    /// The request header that selects a view, and three clients' values:
    /// the first two differ, the third is the first's again.
    fn clients(self) -> [Vec<(&'static str, &'static str)>; 3] {
        let header = match self {
            Rule::Tenant => "x-tenant",
            Rule::Language => "accept-language",
            Rule::Authorization => "authorization",
            Rule::Cookie => "cookie",
            // Anonymous clients: the origin tells them apart.
            Rule::Private | Rule::SetsCookie => return [vec![], vec![], vec![]],
        };
        let (a, b) = match self {
            Rule::Tenant => ("acme", "evil"),
            Rule::Language => ("en", "fr"),
            Rule::Authorization => ("Bearer alpha", "Bearer bravo"),
            _ => ("session=alpha", "session=bravo"),
        };
        [vec![(header, a)], vec![(header, b)], vec![(header, a)]]
    }

    /// Whether clients whose headers are equal have the same view.
    fn shared_by_equals(self) -> bool {
        !matches!(self, Rule::Private | Rule::SetsCookie)
    }
}

/// The origin: every answer's body is `<view> n=<k>.`, where the view is
/// the value of the rule's request header and `k` counts the requests of
/// that path; it records each request's path and view.
#[derive(Clone, Default)]
struct Origin {
    count: Arc<AtomicUsize>,
    asked: Arc<Mutex<Vec<(String, String)>>>,
}

impl Origin {
    async fn start(&self) -> SocketAddr {
        let origin = self.clone();
        common::serve(move |req| origin.answer(req)).await
    }

    fn answer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let n = self.count.fetch_add(1, Ordering::SeqCst);
        let path = req.uri().path().to_string();
        let view_of = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_string()
        };
        let rule = RULES.iter().find(|r| r.path() == path).copied();
        let view = match rule {
            Some(Rule::Tenant) => view_of("x-tenant"),
            Some(Rule::Language) => view_of("accept-language"),
            Some(Rule::Authorization) => view_of("authorization"),
            Some(Rule::Cookie) => view_of("cookie"),
            _ => "anyone".to_string(),
        };
        self.asked
            .lock()
            .expect("lock")
            .push((req.uri().to_string(), view.clone()));
        let mut response = Response::builder()
            .header("content-type", "text/plain")
            .header("etag", format!("\"n{n}\""));
        response = match rule {
            Some(Rule::Tenant) => response
                .header("vary", "X-Tenant")
                .header("cache-control", "max-age=600"),
            Some(Rule::Language) => response
                .header("vary", "Accept-Language")
                .header("cache-control", "max-age=600"),
            Some(Rule::Private) => response.header("cache-control", "private, max-age=600"),
            Some(Rule::SetsCookie) => response
                .header("set-cookie", format!("s={n}"))
                .header("cache-control", "max-age=600"),
            // A shared cache reuses an answer to a request with
            // `Authorization` only when told it may (RFC 9111 §3.5).
            Some(Rule::Authorization) => response.header("cache-control", "public, max-age=600"),
            _ => response.header("cache-control", "max-age=600"),
        };
        let body = format!("{view} n={n}.");
        response
            .body(Full::new(Bytes::from(body)))
            .expect("response")
    }

    /// How many requests for `uri` carried `view`.
    fn asked_for(&self, uri: &str, view: &str) -> usize {
        self.asked
            .lock()
            .expect("lock")
            .iter()
            .filter(|(u, v)| u == uri && v == view)
            .count()
    }
}

/// A chain of `depth` tiers in front of `origin`; the last one's address.
async fn chain(origin: SocketAddr, depth: usize, h2c: bool) -> SocketAddr {
    let mut upstream = origin;
    for tier in 0..depth {
        let (addr, _) = common::proxy_for(upstream, |c| {
            c.upstream_h2c = h2c && tier > 0;
        })
        .await;
        upstream = addr;
    }
    upstream
}

/// What a client got: the view its answer names and the request counter.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    view: String,
    n: String,
}

fn parse(text: &str) -> Seen {
    let text = text.trim();
    let (view, n) = text
        .rsplit_once(" n=")
        .unwrap_or_else(|| panic!("not an origin body: {text:?}"));
    Seen {
        view: view.to_string(),
        n: n.trim_end_matches('.').to_string(),
    }
}

/// A plain GET's body.
async fn get(addr: SocketAddr, uri: &str, headers: &[(&str, &str)]) -> (Seen, ()) {
    let response = common::get(addr, uri, headers).await;
    assert_eq!(response.status().as_u16(), 200, "GET {uri}");
    let body = common::body_of(response).await;
    (parse(&String::from_utf8_lossy(&body)), ())
}

/// A subscription's first update body (the snapshot); the response is
/// kept open in the returned body until dropped.
async fn subscribe(addr: SocketAddr, uri: &str, headers: &[(&str, &str)]) -> (Seen, Incoming) {
    let mut all: Vec<(&str, &str)> = headers.to_vec();
    all.push(("subscribe", "true"));
    let response = common::get(addr, uri, &all).await;
    assert_eq!(response.status().as_u16(), 209, "subscribe {uri}");
    let mut body = response.into_body();
    let mut seen = Vec::new();
    let text = tokio::time::timeout(WAIT, async {
        loop {
            let frame = body
                .frame()
                .await
                .expect("the stream goes on")
                .expect("a frame");
            if let Some(data) = frame.data_ref() {
                seen.extend_from_slice(data);
            }
            let text = String::from_utf8_lossy(&seen).into_owned();
            if let Some(start) = text.find("\r\n\r\n") {
                let rest = &text[start + 4..];
                if rest.contains('.') {
                    return rest[..=rest.find('.').unwrap_or(0)].to_string();
                }
            }
        }
    })
    .await
    .expect("a first update in time");
    (parse(&text), body)
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Get,
    Subscription,
}

/// One cell of the matrix: three clients of `rule` at `addr`, one after
/// another or all at once; returns what each saw.
async fn cell(addr: SocketAddr, rule: Rule, kind: Kind, at_once: bool, uri: &str) -> Vec<Seen> {
    let clients = rule.clients();
    let ask = |headers: Vec<(&'static str, &'static str)>| {
        let uri = uri.to_string();
        async move {
            match kind {
                Kind::Get => {
                    let (seen, ()) = get(addr, &uri, &headers).await;
                    (seen, None)
                }
                Kind::Subscription => {
                    let (seen, body) = subscribe(addr, &uri, &headers).await;
                    (seen, Some(body))
                }
            }
        }
    };
    let mut answers = Vec::new();
    if at_once {
        let [a, b, c] = clients;
        let (a, b, c) = tokio::join!(ask(a), ask(b), ask(c));
        answers.extend([a, b, c]);
    } else {
        for headers in clients {
            // Earlier subscriptions stay open while later ones come.
            answers.push(ask(headers).await);
        }
    }
    let seen = answers.iter().map(|(s, _)| s.clone()).collect();
    drop(answers);
    seen
}

/// Checks one cell's answers against the rule.
fn check(rule: Rule, seen: &[Seen], origin: &Origin, uri: &str, what: &str, shared_race: bool) {
    let clients = rule.clients();
    for (i, (headers, got)) in clients.iter().zip(seen).enumerate() {
        if let Some((_, value)) = headers.first() {
            assert_eq!(
                got.view, *value,
                "{what}: client {i} got another view: {seen:?}"
            );
        }
    }
    if rule.shared_by_equals() {
        assert_ne!(seen[0].view, seen[1].view, "{what}: {seen:?}");
        // The same view is one upstream answer's, shared.
        assert_eq!(
            seen[0].n, seen[2].n,
            "{what}: clients with one view share one answer: {seen:?}"
        );
        // And one origin request's, but where subscriptions of several
        // views race on first contact: one of them may be sent up while
        // another's answer is seeding the resource they then share.
        if !shared_race {
            assert_eq!(
                origin.asked_for(uri, &seen[0].view),
                1,
                "{what}: clients with one view share one request: {seen:?}"
            );
        }
    } else {
        let mut ns: Vec<&str> = seen.iter().map(|s| s.n.as_str()).collect();
        ns.sort_unstable();
        ns.dedup();
        assert_eq!(
            ns.len(),
            3,
            "{what}: one client's answer went to another: {seen:?}"
        );
    }
}

async fn matrix(depth: usize, h2c: bool) {
    let origin = Origin::default();
    let addr = chain(origin.start().await, depth, h2c).await;
    let mut case = 0;
    for rule in RULES {
        for kind in [Kind::Get, Kind::Subscription] {
            for at_once in [false, true] {
                case += 1;
                // Each cell its own URL: nothing stored by one cell serves another.
                let uri = format!("{}?cell={case}", rule.path());
                let seen = cell(addr, rule, kind, at_once, &uri).await;
                let what = format!(
                    "{rule:?} {kind:?} {} at tier {depth}{}",
                    if at_once {
                        "all at once"
                    } else {
                        "one after another"
                    },
                    if h2c { " over h2c" } else { "" }
                );
                let race = at_once && matches!(kind, Kind::Subscription);
                check(rule, &seen, &origin, &uri, &what, race);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_tier() {
    matrix(1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge() {
    matrix(2, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_over_h2c() {
    matrix(2, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn third_tier() {
    matrix(3, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn third_tier_over_h2c() {
    matrix(3, true).await;
}

/// Reads a subscription until an update whose body contains `want`.
async fn until_body(body: &mut Incoming, want: &str) {
    let mut seen = Vec::new();
    tokio::time::timeout(WAIT, async {
        while !String::from_utf8_lossy(&seen).contains(want) {
            let frame = body
                .frame()
                .await
                .expect("the stream goes on")
                .expect("a frame");
            if let Some(data) = frame.data_ref() {
                seen.extend_from_slice(data);
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "no update with {want:?}: {:?}",
            String::from_utf8_lossy(&seen)
        )
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_refresh_reach_every_variant_and_every_subscriber() {
    // `/lang` varies on Accept-Language; `/mine` is private. The body
    // names the origin's generation, bumped by the test.
    let generation = Arc::new(AtomicUsize::new(1));
    let g = generation.clone();
    let origin = common::serve(move |req| {
        let g = g.load(Ordering::SeqCst);
        let lang = req
            .headers()
            .get("accept-language")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_string();
        let (cc, body) = match req.uri().path() {
            "/lang" => ("max-age=600", format!("{lang} n=g{g}.")),
            _ => ("private, max-age=600", format!("mine n=g{g}.")),
        };
        Response::builder()
            .header("vary", "Accept-Language")
            .header("cache-control", cc)
            .header("etag", format!("\"g{g}\""))
            .body(Full::new(Bytes::from(body)))
            .expect("response")
    })
    .await;
    let (addr, admin) = common::proxy_for(origin, |_| {}).await;
    for (action, target) in [("purge", "/purge?path="), ("refresh", "/refresh?path=")] {
        let before = generation.load(Ordering::SeqCst);
        let mut streams = Vec::new();
        for (path, lang) in [
            ("/lang", "en"),
            ("/lang", "fr"),
            ("/mine", "en"),
            ("/mine", "en"),
        ] {
            let (seen, body) = subscribe(addr, path, &[("accept-language", lang)]).await;
            assert_eq!(seen.n, format!("g{before}"), "{path} {lang}");
            streams.push(body);
        }
        generation.fetch_add(1, Ordering::SeqCst);
        // The update may be a patch: its version says what it is.
        let now = format!("Version: \"g{}\"", before + 1);
        for path in ["/lang", "/mine"] {
            let answer = common::request(admin, "POST", &format!("{target}{path}"), &[]).await;
            assert!(answer.status().is_success(), "{action} {path}");
        }
        for body in &mut streams {
            until_body(body, &now).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_do_not_queue_behind_an_answer_that_cannot_be_stored() {
    // Every answer is `no-store` and takes 300 ms: after the first, the
    // GETs that waited for it go to the origin together, not in turn.
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (now, top) = (in_flight.clone(), most.clone());
    let origin = common::serve_async(move |_req: Request<Incoming>| {
        let (now, top) = (now.clone(), top.clone());
        async move {
            let n = now.fetch_add(1, Ordering::SeqCst) + 1;
            top.fetch_max(n, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(300)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            Response::builder()
                .header("cache-control", "no-store")
                .body(Full::new(Bytes::from_static(b"fresh n=0.")))
                .expect("response")
        }
    })
    .await;
    let (addr, _) = common::proxy_for(origin, |_| {}).await;
    let asks = (0..5).map(|_| get(addr, "/uncacheable", &[]));
    let answers = futures_util::future::join_all(asks).await;
    assert_eq!(answers.len(), 5);
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "the waiters were sent one at a time"
    );
}

/// A Braid origin written by hand: every request is answered 209 with
/// `Vary: X-Tenant` and one snapshot naming the tenant and the request
/// count, and the stream stays open. Returns its address and the
/// requests' tenants.
async fn braid_origin_with_vary() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let asked: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = asked.clone();
    let addr = common::wire::raw_upstream(move |head| {
        let head = head.to_ascii_lowercase();
        let tenant = head
            .lines()
            .find_map(|l| l.strip_prefix("x-tenant:"))
            .map_or("none".to_string(), |t| t.trim().to_string());
        let n = {
            let mut log = log.lock().expect("lock");
            log.push(tenant.clone());
            log.len()
        };
        let body = format!("{tenant} n={n}.");
        format!(
            "HTTP/1.1 209 Multiresponse\r\nsubscribe: true\r\nvary: X-Tenant, Version, Parents, Subscribe\r\n\
             cache-control: no-cache, no-transform, no-store\r\nconnection: close\r\n\r\n\
             Version: \"v{n}\"\r\nContent-Length: {}\r\n\r\n{body}\r\n\r\n",
            body.len()
        )
        .into_bytes()
    })
    .await;
    (addr, asked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_braid_origins_vary_holds_behind_two_tiers() {
    let (origin, asked) = braid_origin_with_vary().await;
    for h2c in [false, true] {
        asked.lock().expect("lock").clear();
        let edge = chain(origin, 2, h2c).await;
        let path = if h2c { "/doc-h2c" } else { "/doc" };
        // One after another, the first subscriptions held open.
        let mut open = Vec::new();
        for tenant in ["acme", "evil", "acme"] {
            let (seen, body) = subscribe(edge, path, &[("x-tenant", tenant)]).await;
            assert_eq!(seen.view, tenant, "h2c {h2c}: another tenant's view");
            open.push((seen, body));
        }
        assert_eq!(open[0].0.n, open[2].0.n, "one view, one answer");
        // And all at once, on another URL.
        let all = format!("{path}-all");
        let (a, b, c) = tokio::join!(
            subscribe(edge, &all, &[("x-tenant", "acme")]),
            subscribe(edge, &all, &[("x-tenant", "evil")]),
            subscribe(edge, &all, &[("x-tenant", "acme")]),
        );
        assert_eq!((a.0.view.as_str(), b.0.view.as_str()), ("acme", "evil"));
        assert_eq!(c.0.view, "acme");
        let asked = asked.lock().expect("lock").clone();
        assert_eq!(
            asked.iter().filter(|t| *t == "evil").count(),
            2,
            "h2c {h2c}: one upstream subscription per URL for evil: {asked:?}"
        );
        assert!(
            asked.iter().filter(|t| *t == "acme").count() <= 3,
            "h2c {h2c}: acme's subscribers share: {asked:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_at_an_edge_is_never_older_than_its_subscribers() {
    // One document whose answers say max-age=600; the test changes it.
    let generation = Arc::new(AtomicUsize::new(1));
    let g = generation.clone();
    let origin = common::serve(move |_req| {
        let g = g.load(Ordering::SeqCst);
        Response::builder()
            .header("cache-control", "max-age=600")
            .header("etag", format!("\"g{g}\""))
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from(format!("doc n=g{g}."))))
            .expect("response")
    })
    .await;
    let (first, first_admin) = common::proxy_for(origin, |_| {}).await;
    let (edge, _) = common::proxy_for(first, |_| {}).await;
    // braid-http's client names its peer: the edge's upstream
    // subscription is then that peer's, and plain GETs are not answered
    // from its model.
    let (seen, mut stream) = subscribe(edge, "/doc", &[("peer", "\"p1\"")]).await;
    assert_eq!(seen.n, "g1");
    // A GET at the edge stores the answer (fresh for ten minutes).
    let (got, ()) = get(edge, "/doc", &[]).await;
    assert_eq!(got.n, "g1");
    for round in 2..=4 {
        generation.store(round, Ordering::SeqCst);
        let refreshed = common::request(first_admin, "POST", "/refresh?path=/doc", &[]).await;
        assert!(refreshed.status().is_success());
        // The edge's subscriber has the new version...
        until_body(&mut stream, &format!("Version: \"g{round}\"")).await;
        // ...and so does a GET at that edge, whatever it stored before.
        let (got, ()) = get(edge, "/doc", &[]).await;
        assert_eq!(
            got.n,
            format!("g{round}"),
            "a GET older than the subscribers"
        );
    }
}
