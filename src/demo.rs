//! The embedded demo origin started when no `--upstream` is given: a plain
//! REST server (no Braid) with a few documents, one of which changes by
//! itself every second, and which accepts PUT and DELETE.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// Largest document the demo accepts in a PUT.
const MAX_DOC: usize = 1024 * 1024;

#[derive(Clone)]
struct Doc {
    body: Bytes,
    content_type: String,
    etag: u64,
}

#[derive(Default)]
struct Store {
    docs: HashMap<String, Doc>,
    next_etag: u64,
}

impl Store {
    fn put(&mut self, path: &str, body: Bytes, content_type: &str) {
        self.next_etag += 1;
        let doc = Doc {
            body,
            content_type: content_type.to_string(),
            etag: self.next_etag,
        };
        self.docs.insert(path.to_string(), doc);
    }
}

type Shared = Arc<Mutex<Store>>;

/// Serves the demo origin on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener) {
    let store: Shared = Arc::default();
    {
        let mut s = store.lock().unwrap_or_else(|p| p.into_inner());
        s.put(
            "/",
            Bytes::from_static(INDEX.as_bytes()),
            "text/html; charset=utf-8",
        );
        s.put(
            "/notes.txt",
            Bytes::from_static(b"Edit me with PUT.\n"),
            "text/plain; charset=utf-8",
        );
        s.put(
            "/data.json",
            Bytes::from_static(b"{\n  \"greeting\": \"hello\",\n  \"count\": 0\n}\n"),
            "application/json",
        );
        s.put("/clock", clock_text(0), "text/plain; charset=utf-8");
        s.put(
            "/braid-proxy-client.js",
            Bytes::from_static(CLIENT.as_bytes()),
            "text/javascript; charset=utf-8",
        );
    }
    let ticking = store.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut n = 0u64;
        loop {
            tick.tick().await;
            n += 1;
            let mut s = ticking.lock().unwrap_or_else(|p| p.into_inner());
            s.put("/clock", clock_text(n), "text/plain; charset=utf-8");
        }
    });
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let store = store.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let store = store.clone();
                async move { Ok::<_, Infallible>(handle(req, &store).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn clock_text(n: u64) -> Bytes {
    let now = httpdate::fmt_http_date(std::time::SystemTime::now());
    Bytes::from(format!(
        "The demo origin's clock.\nTick: {n}\nTime: {now}\nThis line stays the same.\n"
    ))
}

async fn handle(req: Request<Incoming>, store: &Shared) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    match *req.method() {
        Method::GET | Method::HEAD => {
            let doc = store
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .docs
                .get(&path)
                .cloned();
            let Some(doc) = doc else {
                return plain(StatusCode::NOT_FOUND, "no such document\n");
            };
            let etag = format!("\"d{}\"", doc.etag);
            let not_modified = req
                .headers()
                .get(header::IF_NONE_MATCH)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
            let mut r = if not_modified {
                let mut r = Response::new(Full::new(Bytes::new()));
                *r.status_mut() = StatusCode::NOT_MODIFIED;
                r
            } else {
                let mut r = Response::new(Full::new(doc.body.clone()));
                if let Ok(ct) = HeaderValue::from_str(&doc.content_type) {
                    r.headers_mut().insert(header::CONTENT_TYPE, ct);
                }
                r
            };
            if let Ok(v) = HeaderValue::from_str(&etag) {
                r.headers_mut().insert(header::ETAG, v);
            }
            r
        }
        Method::PUT => {
            let content_type = req
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("text/plain; charset=utf-8")
                .to_string();
            let body = match Limited::new(req.into_body(), MAX_DOC).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => {
                    return plain(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "documents are limited to 1 MiB\n",
                    )
                }
            };
            store
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .put(&path, body, &content_type);
            plain(StatusCode::OK, "stored\n")
        }
        Method::DELETE => {
            let removed = store
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .docs
                .remove(&path);
            match removed {
                Some(_) => plain(StatusCode::OK, "deleted\n"),
                None => plain(StatusCode::NOT_FOUND, "no such document\n"),
            }
        }
        _ => {
            let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "use GET, PUT or DELETE\n");
            r.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static("GET, HEAD, PUT, DELETE"),
            );
            r
        }
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// The demo's index page: the live example of examples/browser/, which
/// subscribes to the documents through the proxy and writes to one.
const INDEX: &str = include_str!("../examples/browser/index.html");

/// The page's Braid-HTTP client, the project's own, built in so that the
/// demo needs nothing installed (no npm package, no CDN).
const CLIENT: &str = include_str!("../examples/browser/braid-proxy-client.js");
