//! The operations listener: the operator's page (`/`, which polls
//! `/status`), `/metrics`, `/healthz`, `/readyz`, `POST /refresh?path=/x`
//! and `POST /purge`; each refresh and purge is also published on this
//! proxy's purge feed for the tiers below (src/purges.rs).

use std::convert::Infallible;
use std::time::Instant;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::error::Refusal;
use crate::floor::body::{self, Body};
use crate::purges::Purge;
use crate::router::Router;

/// Serves the admin listener until the task is aborted, probing the
/// upstream in the background so that `/readyz` follows it.
pub async fn serve(listener: TcpListener, router: Router) {
    let started = std::time::Instant::now();
    let prober = router.clone();
    let probes = tokio::spawn(async move {
        let every = prober.config().poll_interval.clamp(
            std::time::Duration::from_millis(250),
            std::time::Duration::from_secs(5),
        );
        let mut closing = prober.closing();
        loop {
            prober.probe_upstream().await;
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = closing.changed() => return,
            }
        }
    });
    let _probes = AbortOnDrop(probes);
    let mut errors = crate::limits::AcceptErrors::new("admin");
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tokio::time::sleep(errors.failed(&e)).await;
                continue;
            }
        };
        errors.accepted();
        let router = router.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let router = router.clone();
                async move { Ok::<_, Infallible>(handle(req, &router, started).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether the request carries the admin token (`Authorization: Bearer`),
/// compared in constant time; always true when no token is configured.
fn authorized(req: &Request<Incoming>, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    let Some(given) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The operator's page: self-contained (no external assets); it polls
/// `/status` every second.
const PAGE: &str = include_str!("status.html");

async fn handle(req: Request<Incoming>, router: &Router, started: Instant) -> Response<Body> {
    // Liveness and readiness stay open to load balancers; the rest needs
    // the token when one is configured.
    let open = matches!(req.uri().path(), "/healthz" | "/readyz");
    if !open && !authorized(&req, router.config().admin_token.as_deref()) {
        let mut r = text(
            StatusCode::UNAUTHORIZED,
            "the admin listener needs Authorization: Bearer <admin-token>\n".into(),
            "text/plain",
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    let result = match (req.method(), req.uri().path()) {
        (&Method::GET, "/") => Ok(text(
            StatusCode::OK,
            PAGE.into(),
            "text/html; charset=utf-8",
        )),
        (&Method::GET, "/status") => Ok(status(router, started)),
        (&Method::GET, "/metrics") => Ok(text(
            StatusCode::OK,
            router.render_metrics(),
            "text/plain; version=0.0.4",
        )),
        (&Method::GET, "/healthz") => Ok(text(StatusCode::OK, "ok\n".into(), "text/plain")),
        (&Method::GET, "/readyz") => Ok(match router.readiness() {
            Ok(()) => text(StatusCode::OK, "ready\n".into(), "text/plain"),
            Err(reason) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {reason}\n"),
                "text/plain",
            ),
        }),
        (_, "/" | "/status" | "/metrics" | "/healthz" | "/readyz") => {
            Err(Refusal::MethodNotAllowed("GET"))
        }
        (&Method::POST, "/refresh") => refresh(&req, router),
        (_, "/refresh") => Err(Refusal::MethodNotAllowed("POST")),
        (&Method::POST, "/purge") => purge(&req, router),
        (_, "/purge") => Err(Refusal::MethodNotAllowed("POST")),
        _ => Err(Refusal::NotFound),
    };
    result.unwrap_or_else(Refusal::into_response)
}

fn refresh(req: &Request<Incoming>, router: &Router) -> Result<Response<Body>, Refusal> {
    let path = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("path="))
        .ok_or_else(|| Refusal::BadRequest("refresh needs ?path=/resource".into()))?;
    let path = percent_decode(path)
        .ok_or_else(|| Refusal::BadRequest("refresh path is not valid percent-encoding".into()))?;
    if !path.starts_with('/') {
        return Err(Refusal::BadRequest("refresh path must start with /".into()));
    }
    let refresh = Purge::Refresh(path);
    refresh.check().map_err(Refusal::BadRequest)?;
    // Published on this proxy's purge feed too, for the tiers below.
    let known = router.apply_purge(&refresh) > 0;
    let msg = if known {
        "refreshing\n"
    } else {
        "not tracked; nothing to refresh\n"
    };
    Ok(text(StatusCode::ACCEPTED, msg.into(), "text/plain"))
}

/// `POST /purge?path=/x` drops every stored variant of a URL; `?tag=T`
/// every stored answer whose `Surrogate-Key` or `Cache-Tag` lists T.
fn purge(req: &Request<Incoming>, router: &Router) -> Result<Response<Body>, Refusal> {
    let query = req.uri().query().unwrap_or("");
    let find = |name: &str| {
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
    };
    let decode = |v: &str| {
        percent_decode(v)
            .ok_or_else(|| Refusal::BadRequest("purge value is not valid percent-encoding".into()))
    };
    let purge = match (find("path"), find("tag")) {
        (Some(path), None) => {
            let path = decode(path)?;
            if !path.starts_with('/') {
                return Err(Refusal::BadRequest("purge path must start with /".into()));
            }
            Purge::Path(path)
        }
        (None, Some(tag)) => {
            let tag = decode(tag)?;
            let tag = tag.trim();
            if tag.is_empty() {
                return Err(Refusal::BadRequest("purge tag is empty".into()));
            }
            Purge::Tag(tag.to_string())
        }
        _ => {
            return Err(Refusal::BadRequest(
                "purge needs ?path=/resource or ?tag=TAG (one of them)".into(),
            ))
        }
    };
    purge.check().map_err(Refusal::BadRequest)?;
    // Published on this proxy's purge feed too, for the tiers below.
    let purged = router.apply_purge(&purge);
    Ok(text(
        StatusCode::OK,
        format!("purged {purged}\n"),
        "text/plain",
    ))
}

/// `GET /status`: the page's data as JSON, never cached.
fn status(router: &Router, started: Instant) -> Response<Body> {
    match serde_json::to_string(&router.status(started)) {
        Ok(json) => {
            let mut r = text(StatusCode::OK, json, "application/json");
            r.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            r
        }
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("status not serializable: {e}\n"),
            "text/plain",
        ),
    }
}

fn text(status: StatusCode, body_text: String, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(body::full(body_text));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Decodes `%XX` escapes (and `+` as space is *not* applied: paths keep `+`).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}
