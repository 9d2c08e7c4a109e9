//! The operations listener: `/metrics`, `/healthz`, `/readyz` and
//! `POST /refresh?path=/x`.

use std::convert::Infallible;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::warn;

use crate::body::{self, Body};
use crate::error::Refusal;
use crate::router::Router;

/// Serves the admin listener until the task is aborted.
pub async fn serve(listener: TcpListener, router: Router) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "admin accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let router = router.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let router = router.clone();
                async move { Ok::<_, Infallible>(handle(req, &router).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(req: Request<Incoming>, router: &Router) -> Response<Body> {
    let result = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => Ok(text(
            StatusCode::OK,
            router.render_metrics(),
            "text/plain; version=0.0.4",
        )),
        (&Method::GET, "/healthz") => Ok(text(StatusCode::OK, "ok\n".into(), "text/plain")),
        (&Method::GET, "/readyz") => Ok(text(StatusCode::OK, "ready\n".into(), "text/plain")),
        (_, "/metrics" | "/healthz" | "/readyz") => Err(Refusal::MethodNotAllowed("GET")),
        (&Method::POST, "/refresh") => refresh(&req, router),
        (_, "/refresh") => Err(Refusal::MethodNotAllowed("POST")),
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
    let known = router.refresh(&path);
    let msg = if known {
        "refreshing\n"
    } else {
        "not tracked; nothing to refresh\n"
    };
    Ok(text(StatusCode::ACCEPTED, msg.into(), "text/plain"))
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
