//! HTTP/1.1 subscriptions written by the proxy itself, without hyper's
//! connection machinery in the steady state.
//!
//! An idle HTTP/1.1 subscription served by hyper holds hyper's read buffer
//! and write buffer (8 KiB each, for the connection's life), and every
//! delivery goes through hyper's connection poll. A subscription needs
//! neither: it reads nothing after its request, and writes one shared,
//! already-encoded update at a time. So when a connection's first request
//! is, whole in the first bytes the client sent, a plain subscription GET
//! (see [`parse`]), the proxy parses it here, routes it as any other
//! request, and writes the response head and the chunked body to the
//! socket itself: per connection it then holds the socket, the response
//! body (a cursor into the shared window) and no buffer. Each chunk is
//! written from the shared `Bytes` with one vectored write (chunk size line,
//! data, CRLF), so nothing is copied and nothing is queued: the next update
//! is computed only once the socket took this one, and a slow reader
//! collapses what it missed, as on any connection.
//!
//! Anything else, or a head that did not arrive in one piece, goes to
//! hyper untouched (nothing was consumed: the head is peeked). After a
//! response ends (a subscription whose upstream ended, or a refusal), the
//! connection goes back to hyper for its next request.

use std::io;
use std::sync::Arc;

use bytes::Buf;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::net::TcpStream;

use crate::deliver::direct;
use crate::deliver::socket::{Socket, Spoke};
use crate::floor::body::{self, Body, RequestBody};
use crate::floor::chunk::ChunkSize;
use crate::tls::socket::TlsSocket;

/// Longest request head looked at; a longer one goes to hyper.
const PEEK_BYTES: usize = 4096;
/// Most request headers parsed here; more go to hyper (which enforces `--max-headers`).
const MAX_HEADERS: usize = 48;

/// A subscription request parsed from the connection's first bytes.
pub struct Parsed {
    /// Bytes of the request head, to consume before answering.
    pub head_len: usize,
    pub request: Request<RequestBody>,
}

/// Peeks at the first request on `stream` and parses it when it is a plain
/// subscription GET that arrived whole, within `--max-header-bytes` and
/// `--max-headers` (hyper refuses the others with its 431). Nothing is consumed.
pub async fn peek(stream: &TcpStream, max_head: usize, max_headers: usize) -> Option<Parsed> {
    let mut buf = vec![0u8; PEEK_BYTES.min(max_head)];
    let n = stream.peek(&mut buf).await.ok()?;
    parse(&buf[..n]).filter(|p| p.request.headers().len() <= max_headers)
}

/// The first bytes a client sent over TLS, decrypted: what came once any
/// did, up to [`PEEK_BYTES`] and `--max-header-bytes`; empty when it
/// closed first. Over TLS nothing can be peeked at, so they are read, and
/// replayed to hyper when the fast path does not take them.
pub async fn first_bytes_tls(tls: &TlsSocket, max_head: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; PEEK_BYTES.min(max_head)];
    let mut filled = 0;
    while filled < buf.len() {
        match tls.try_read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            // Whatever came with the first bytes is all there is to parse.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && filled > 0 => break,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => tls.tcp().readable().await?,
            Err(e) => return Err(e),
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

/// Parses `bytes` as a request head that this module serves: `GET` in
/// origin form, HTTP/1.1, a `Subscribe` header, no body, no upgrade, no
/// `Expect`, no multiplexing and no `Connection` option but keep-alive.
/// Everything else (and anything malformed, which hyper refuses with its
/// own 400) is `None`.
pub fn parse(bytes: &[u8]) -> Option<Parsed> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let head_len = match req.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return None,
    };
    if req.method != Some("GET") || req.version != Some(1) {
        return None;
    }
    let path = req.path.filter(|p| p.starts_with('/'))?;
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    let mut subscribe = false;
    for h in req.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(h.value).ok()?;
        match name.as_str() {
            "subscribe" => subscribe = true,
            "content-length" if value.as_bytes() != b"0" => return None,
            "transfer-encoding" | "upgrade" | "expect" | "multiplex-through"
            | "multiplex-version" => return None,
            "connection" if !value.as_bytes().eq_ignore_ascii_case(b"keep-alive") => return None,
            _ => {}
        }
        headers.append(name, value);
    }
    if !subscribe {
        return None;
    }
    let mut request = Request::new(body::no_request_body());
    *request.method_mut() = Method::GET;
    *request.uri_mut() = path.parse().ok()?;
    *request.version_mut() = http::Version::HTTP_11;
    *request.headers_mut() = headers;
    Some(Parsed { head_len, request })
}

/// How a response written here left the connection.
#[derive(Debug, PartialEq, Eq)]
pub enum After {
    /// The response ended cleanly: the connection can serve another request.
    KeepAlive,
    /// Closed, broken, or left in a state only closing ends.
    Close,
}

/// Waits for the router's answer, unless the client goes away first: then
/// the request is given up (`None`), as hyper gives up a request whose
/// client has gone, so that nothing (a relayed session being opened, say)
/// waits on it. The flag is true when the client sent more bytes meanwhile
/// (they were read and dropped, so the connection closes after the answer).
pub async fn answer_unless_gone(
    stream: &Socket,
    answer: impl std::future::Future<Output = Response<Body>>,
) -> Option<(Response<Body>, bool)> {
    tokio::pin!(answer);
    let gone = stream.closed_or_spoke();
    tokio::pin!(gone);
    let mut spoke = false;
    loop {
        tokio::select! {
            biased;
            response = &mut answer => return Some((response, spoke)),
            said = &mut gone, if !spoke => match said {
                Spoke::Closed => return None,
                Spoke::Spoke => spoke = true,
            },
        }
    }
}

/// Writes `response` to `stream` as HTTP/1.1: the head, then the body with
/// `Content-Length` when its size is known and chunked otherwise. Returns
/// when the body ends, the client goes away, or the body fails (then the
/// connection is closed without the last chunk, so the client sees the
/// stream cut, not ended).
pub async fn write_response(stream: &Arc<Socket>, response: Response<Body>) -> After {
    let (parts, mut body) = response.into_parts();
    let bodiless = parts.status.is_informational()
        || parts.status == StatusCode::NO_CONTENT
        || parts.status == StatusCode::NOT_MODIFIED;
    let length = if bodiless {
        Some(0)
    } else {
        body.size_hint().exact()
    };
    let chunked = length.is_none();
    let mut close = parts
        .headers
        .get(header::CONNECTION)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    let head = encode_head(&parts, length, bodiless);
    // A subscription to a polled resource can be parked for direct delivery.
    let direct = parts
        .extensions
        .get::<direct::Handle>()
        .filter(|_| chunked)
        .cloned();
    // Only the body (and the parking handle) is kept for the life of the response.
    drop(parts);
    if stream.write_all(&mut &head[..]).await.is_err() {
        return After::Close;
    }
    drop(head);
    if bodiless {
        return if close {
            After::Close
        } else {
            After::KeepAlive
        };
    }
    // The client closing (or sending more, which a live response leaves
    // unread) is noticed without a read buffer; one future for the
    // response's life, so a delivery costs no new readiness registration.
    let gone = stream.closed_or_spoke();
    tokio::pin!(gone);
    let mut peer_open = true;
    loop {
        let frame = tokio::select! {
            biased;
            frame = body.frame() => frame,
            spoke = &mut gone, if peer_open => match spoke {
                Spoke::Closed => return After::Close,
                Spoke::Spoke => { peer_open = false; close = true; continue }
            },
        };
        let mut data = match frame {
            None => break,
            Some(Err(_)) => return After::Close,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if data.has_remaining() => data,
                _ => continue,
            },
        };
        let written = if chunked {
            let size = ChunkSize::new(data.remaining());
            let mut buf = size.as_bytes().chain(&mut data).chain(&b"\r\n"[..]);
            stream.write_all(&mut buf).await
        } else {
            stream.write_all(&mut data).await
        };
        if written.is_err() {
            return After::Close;
        }
        // Caught up, and the body holds no pending wait (it just yielded):
        // park until the sweep hands the subscription back.
        if let Some(handle) = &direct {
            match parked(stream, handle, gone.as_mut(), &mut peer_open).await {
                Waited::Behind | Waited::Resumed => {}
                Waited::Spoke => close = true,
                Waited::Closed => return After::Close,
            }
        }
    }
    if chunked && stream.write_all(&mut &b"0\r\n\r\n"[..]).await.is_err() {
        return After::Close;
    }
    if close {
        After::Close
    } else {
        After::KeepAlive
    }
}

/// How a parked wait ended.
enum Waited {
    /// Not caught up: go on polling the body.
    Behind,
    /// Handed back (after writing what the sweep began): go on.
    Resumed,
    /// Handed back because the client sent bytes: go on, close at the end.
    Spoke,
    /// The client closed or the socket broke.
    Closed,
}

/// Parks the subscription if it is caught up, and waits until the sweep
/// hands it back, the client closes, a heartbeat is due, or shutdown
/// begins; then finishes any chunk the sweep began.
async fn parked(
    stream: &Arc<Socket>,
    handle: &direct::Handle,
    mut gone: std::pin::Pin<&mut impl std::future::Future<Output = Spoke>>,
    peer_open: &mut bool,
) -> Waited {
    let Some(ticket) = handle.park(stream) else {
        return Waited::Behind;
    };
    let mut heartbeat = handle.heartbeat.clone();
    if let Some(h) = heartbeat.as_mut() {
        h.borrow_and_update();
    }
    let mut closing = handle.closing.clone();
    enum Why {
        Back(direct::Back),
        Take(Waited),
    }
    let why = tokio::select! {
        biased;
        back = ticket.returned() => Why::Back(back),
        spoke = gone.as_mut(), if *peer_open => match spoke {
            Spoke::Closed => return Waited::Closed,
            Spoke::Spoke => { *peer_open = false; Why::Take(Waited::Spoke) }
        },
        _ = async {
            // Taken back from the sweep only when a heartbeat is due.
            let Some(h) = heartbeat.as_mut() else {
                return std::future::pending().await;
            };
            loop {
                if h.changed().await.is_err() {
                    return std::future::pending().await;
                }
                if *h.borrow_and_update() >= handle.link.beat_due.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
            }
        } => Why::Take(Waited::Resumed),
        _ = closing.changed() => Why::Take(Waited::Resumed),
    };
    let (back, then) = match why {
        Why::Back(back) => (back, Waited::Resumed),
        Why::Take(then) => (ticket.unpark().await, then),
    };
    match back {
        direct::Back::Broken => Waited::Closed,
        // What the sweep began, and over TLS what it left in the session.
        direct::Back::Resume { rest } => {
            if stream
                .write_all(&mut rest.unwrap_or_default())
                .await
                .is_err()
            {
                Waited::Closed
            } else {
                then
            }
        }
    }
}

/// The status line and headers, with the framing header this writer uses
/// (any the response carried are replaced) and a `Date` when there is none.
fn encode_head(parts: &http::response::Parts, length: Option<u64>, bodiless: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + parts.headers.len() * 32);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    let reason = parts
        .extensions
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| r.as_bytes())
        .or_else(|| parts.status.canonical_reason().map(str::as_bytes))
        .unwrap_or_default();
    out.extend_from_slice(reason);
    out.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !parts.headers.contains_key(header::DATE) {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(httpdate::fmt_http_date(std::time::SystemTime::now()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match length {
        _ if bodiless => {}
        Some(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(n.to_string().as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        None => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscription_gets_are_taken_and_everything_else_left_to_hyper() {
        let take = |head: &str| parse(head.as_bytes()).map(|p| p.head_len);
        let sub = "GET /doc?x=1 HTTP/1.1\r\nHost: a\r\nSubscribe: true\r\nParents: \"v1\"\r\n\r\n";
        assert_eq!(take(sub), Some(sub.len()));
        let parsed = parse(sub.as_bytes()).unwrap();
        assert_eq!(parsed.request.uri(), "/doc?x=1");
        assert_eq!(parsed.request.headers()["parents"], "\"v1\"");
        // Pipelined bytes after the head are not part of it.
        assert_eq!(take(&format!("{sub}GET / HTTP/1.1\r\n")), Some(sub.len()));
        for other in [
            "GET /doc HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET /doc HTTP/1.0\r\nSubscribe: true\r\n\r\n",
            "PUT /doc HTTP/1.1\r\nSubscribe: true\r\n\r\n",
            "GET http://a/doc HTTP/1.1\r\nSubscribe: true\r\n\r\n",
            "GET /doc HTTP/1.1\r\nSubscribe: true\r\n",
            "GET /doc HTTP/1.1\r\nSubscribe: true\r\nContent-Length: 5\r\n\r\n",
            "GET /doc HTTP/1.1\r\nSubscribe: true\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET /doc HTTP/1.1\r\nSubscribe: true\r\nUpgrade: h2c\r\n\r\n",
            "GET /doc HTTP/1.1\r\nSubscribe: true\r\nConnection: close\r\n\r\n",
            "GET /doc HTTP/1.1\r\nSubscribe: true\r\nMultiplex-Through: /.well-known/multiplexer/m/r\r\n\r\n",
            "GET /doc HTTP/1.1\r\nSub scribe: true\r\n\r\n",
        ] {
            assert_eq!(take(other), None, "{other:?}");
        }
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("X-{i}: 1\r\n"))
            .collect();
        assert_eq!(
            take(&format!("GET / HTTP/1.1\r\nSubscribe: true\r\n{many}\r\n")),
            None
        );
    }

    #[test]
    fn heads_carry_the_reason_and_one_framing_header() {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(209).unwrap();
        response
            .extensions_mut()
            .insert(hyper::ext::ReasonPhrase::from_static(b"Subscription"));
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("9"));
        response
            .headers_mut()
            .insert("subscribe", HeaderValue::from_static("true"));
        let (parts, ()) = response.into_parts();
        let head = String::from_utf8(encode_head(&parts, None, false)).unwrap();
        assert!(head.starts_with("HTTP/1.1 209 Subscription\r\nsubscribe: true\r\ndate: "));
        assert!(head.ends_with("transfer-encoding: chunked\r\n\r\n"));
        assert!(!head.contains("content-length"));
        let head = String::from_utf8(encode_head(&parts, Some(9), false)).unwrap();
        assert!(head.ends_with("content-length: 9\r\n\r\n"));
    }
}
