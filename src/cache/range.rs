//! Byte ranges of a stored answer (RFC 9110 §14): a GET with `Range` whose
//! stored 200 may be reused is answered from state with a 206 (one range,
//! or `multipart/byteranges` for several) or a 416, and `If-Range` decides
//! between the range and the whole answer. Ranges count the bytes as
//! stored, coded ones included (a `Content-Encoding` is not undone).

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};

use crate::floor::body::{self, Body};

/// Most ranges answered in one request; more are answered with the whole
/// representation (RFC 9110 §14.2 lets a server ignore such a `Range`).
pub const MAX_RANGES: usize = 16;

/// Longest `Range` value read; a longer one is ignored.
const MAX_RANGE_HEADER: usize = 1024;

/// What a `Range` header asks of a representation `len` bytes long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ranges {
    /// Serve the whole representation: no `Range`, one that is not valid
    /// `bytes` syntax, or one this proxy declines (too many ranges,
    /// overlapping ranges).
    Whole,
    /// The satisfiable ranges, as inclusive (first, last) byte positions,
    /// in the order asked.
    Parts(Vec<(u64, u64)>),
    /// Valid, but no range overlaps the representation: 416.
    Unsatisfiable,
}

/// Parses a `Range` value (RFC 9110 §14.1.2) against a length.
pub fn parse(value: &str, len: u64) -> Ranges {
    if value.len() > MAX_RANGE_HEADER {
        return Ranges::Whole;
    }
    let Some((unit, set)) = value.trim().split_once('=') else {
        return Ranges::Whole;
    };
    if !unit.trim().eq_ignore_ascii_case("bytes") {
        return Ranges::Whole;
    }
    let mut parts = Vec::new();
    let mut specs = 0;
    for spec in set.split(',') {
        let spec = spec.trim();
        if spec.is_empty() {
            continue; // empty list elements are allowed (RFC 9110 §5.6.1)
        }
        specs += 1;
        if specs > MAX_RANGES {
            return Ranges::Whole;
        }
        let Some((first, last)) = spec.split_once('-') else {
            return Ranges::Whole;
        };
        let (first, last) = (first.trim(), last.trim());
        let number = |s: &str| -> Option<u64> {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u64>().unwrap_or(u64::MAX))
        };
        if first.is_empty() {
            // suffix-range: the last N bytes.
            let Some(n) = number(last) else {
                return Ranges::Whole;
            };
            if n > 0 && len > 0 {
                parts.push((len - n.min(len), len - 1));
            }
            continue;
        }
        let Some(first) = number(first) else {
            return Ranges::Whole;
        };
        let last = if last.is_empty() {
            None
        } else {
            match number(last) {
                Some(last) if last >= first => Some(last),
                _ => return Ranges::Whole,
            }
        };
        if first < len {
            parts.push((first, last.map_or(len - 1, |l| l.min(len - 1))));
        }
    }
    if specs == 0 {
        return Ranges::Whole;
    }
    if parts.is_empty() {
        return Ranges::Unsatisfiable;
    }
    // Overlapping ranges are a known abuse (RFC 9110 §17.15): whole answer.
    let mut sorted = parts.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[1].0 <= w[0].1) {
        return Ranges::Whole;
    }
    Ranges::Parts(parts)
}

/// Whether `If-Range` lets the range apply (RFC 9110 §13.1.5): an entity
/// tag must equal the stored strong `ETag` (strong comparison); a date
/// must equal the stored `Last-Modified`, itself strong (the `Date` at
/// least a second later).
pub fn if_range_matches(value: &str, stored: &HeaderMap) -> bool {
    let value = value.trim();
    let text = |name| stored.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    if value.starts_with('"') || value.starts_with("W/") {
        let strong = |t: &str| t.starts_with('"') && t.len() >= 2 && t.ends_with('"');
        return match text(header::ETAG).map(str::trim) {
            Some(etag) => strong(value) && strong(etag) && value == etag,
            None => false,
        };
    }
    let date = |name| text(name).and_then(|v| httpdate::parse_http_date(v.trim()).ok());
    let (Ok(asked), Some(modified), Some(date)) = (
        httpdate::parse_http_date(value),
        date(header::LAST_MODIFIED),
        date(header::DATE),
    ) else {
        return false;
    };
    asked == modified
        && date
            .duration_since(modified)
            .is_ok_and(|d| d >= std::time::Duration::from_secs(1))
}

/// Turns a whole 200 answered from state into the answer to the request's
/// `Range`: a 206, a 416, or the 200 as it is (no `Range`, not a GET, an
/// `If-Range` that does not match, a `Range` declined). `whole` is the
/// stored body the 200 carries.
pub fn answer<B>(req: &Request<B>, whole: &Bytes, response: Response<Body>) -> Response<Body> {
    if req.method() != Method::GET || response.status() != StatusCode::OK {
        return response;
    }
    let Some(range) = req
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
    else {
        return response;
    };
    if let Some(if_range) = req.headers().get(header::IF_RANGE) {
        let matches = if_range
            .to_str()
            .is_ok_and(|v| if_range_matches(v, response.headers()));
        if !matches {
            return response;
        }
    }
    let len = whole.len() as u64;
    let (mut parts, _) = response.into_parts();
    parts
        .headers
        .insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    match parse(range, len) {
        Ranges::Whole => Response::from_parts(parts, body::full(whole.clone())),
        Ranges::Unsatisfiable => {
            parts.status = StatusCode::RANGE_NOT_SATISFIABLE;
            let h = &mut parts.headers;
            h.insert(header::CONTENT_RANGE, content_range(None, len));
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(0));
            h.remove(header::CONTENT_TYPE);
            h.remove(header::CONTENT_ENCODING);
            Response::from_parts(parts, body::empty())
        }
        Ranges::Parts(ranges) => {
            parts.status = StatusCode::PARTIAL_CONTENT;
            let slice = |(first, last): (u64, u64)| whole.slice(first as usize..=last as usize);
            let h = &mut parts.headers;
            if let [one] = ranges[..] {
                h.insert(header::CONTENT_RANGE, content_range(Some(one), len));
                h.insert(header::CONTENT_LENGTH, HeaderValue::from(one.1 - one.0 + 1));
                return Response::from_parts(parts, body::full(slice(one)));
            }
            let boundary = boundary_for(whole);
            let part_type = h.get(header::CONTENT_TYPE).cloned();
            let mut out = BytesMut::new();
            for range in &ranges {
                out.extend_from_slice(format!("\r\n--{boundary}\r\n").as_bytes());
                if let Some(t) = &part_type {
                    out.extend_from_slice(b"Content-Type: ");
                    out.extend_from_slice(t.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"Content-Range: ");
                out.extend_from_slice(content_range(Some(*range), len).as_bytes());
                out.extend_from_slice(b"\r\n\r\n");
                out.extend_from_slice(&slice(*range));
            }
            out.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
            if let Ok(v) =
                HeaderValue::from_str(&format!("multipart/byteranges; boundary={boundary}"))
            {
                h.insert(header::CONTENT_TYPE, v);
            }
            h.remove(header::CONTENT_RANGE);
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(out.len()));
            Response::from_parts(parts, body::full(out.freeze()))
        }
    }
}

/// `bytes first-last/len`, or `bytes */len` for a 416.
fn content_range(range: Option<(u64, u64)>, len: u64) -> HeaderValue {
    let text = match range {
        Some((first, last)) => format!("bytes {first}-{last}/{len}"),
        None => format!("bytes */{len}"),
    };
    HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("bytes */0"))
}

/// A multipart boundary that does not occur in the body: a hash of it,
/// lengthened in the (unlikely) case it does.
fn boundary_for(whole: &Bytes) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(whole);
    let mut boundary: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    boundary.insert_str(0, "braid-proxy-");
    let mut extra = 0u32;
    while contains(whole, boundary.as_bytes()) && extra < 8 {
        extra += 1;
        boundary.push_str(&format!("{extra}"));
    }
    boundary
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    let Some((&first, _)) = needle.split_first() else {
        return true;
    };
    haystack
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == first)
        .any(|(i, _)| haystack[i..].starts_with(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse() {
        use Ranges::*;
        assert_eq!(parse("bytes=0-1", 10), Parts(vec![(0, 1)]));
        assert_eq!(parse("bytes=1-", 10), Parts(vec![(1, 9)]));
        assert_eq!(parse("bytes=-1", 10), Parts(vec![(9, 9)]));
        assert_eq!(parse("bytes=-20", 10), Parts(vec![(0, 9)]));
        assert_eq!(parse("bytes=5-100", 10), Parts(vec![(5, 9)]));
        assert_eq!(parse("BYTES = 0-0 , 4-5", 10), Parts(vec![(0, 0), (4, 5)]));
        assert_eq!(parse("bytes=8-9,0-1", 10), Parts(vec![(8, 9), (0, 1)]));
        // One satisfiable range among unsatisfiable ones.
        assert_eq!(parse("bytes=0-1,50-60", 10), Parts(vec![(0, 1)]));
        assert_eq!(parse("bytes=10-", 10), Unsatisfiable);
        assert_eq!(parse("bytes=-0", 10), Unsatisfiable);
        assert_eq!(parse("bytes=0-", 0), Unsatisfiable);
        // Invalid syntax and declined ones: the whole representation.
        for v in [
            "bytes=5-1",
            "bytes=a-b",
            "bytes=",
            "items=0-1",
            "bytes 0-1",
            "bytes=1",
            "bytes=0-1-2",
            "bytes=0-5,3-8",
            "bytes=0-5,5-8",
        ] {
            assert_eq!(parse(v, 10), Whole, "{v}");
        }
        let many = (0..17)
            .map(|i| format!("{i}-{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(parse(&format!("bytes={many}"), 100), Whole);
        let sixteen = (0..16)
            .map(|i| format!("{}-{}", 2 * i, 2 * i))
            .collect::<Vec<_>>()
            .join(",");
        assert!(matches!(parse(&format!("bytes={sixteen}"), 100), Parts(p) if p.len() == 16));
        assert_eq!(parse(&format!("bytes=0-1{}", " ".repeat(2000)), 10), Whole);
        assert_eq!(parse("bytes=99999999999999999999999-", 10), Unsatisfiable);
    }

    #[test]
    fn if_range_compares_strongly() {
        let mut h = HeaderMap::new();
        h.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
        assert!(if_range_matches("\"v1\"", &h));
        assert!(!if_range_matches("\"v2\"", &h));
        assert!(!if_range_matches("W/\"v1\"", &h));
        h.insert(header::ETAG, HeaderValue::from_static("W/\"v1\""));
        assert!(!if_range_matches("W/\"v1\"", &h));
        let lm = "Sun, 06 Dec 2026 10:00:00 GMT";
        h.insert(header::LAST_MODIFIED, HeaderValue::from_static(lm));
        h.insert(
            header::DATE,
            HeaderValue::from_static("Sun, 06 Dec 2026 11:00:00 GMT"),
        );
        assert!(if_range_matches(lm, &h));
        assert!(!if_range_matches("Sun, 06 Dec 2026 09:00:00 GMT", &h));
        assert!(!if_range_matches("yesterday", &h));
        // A Last-Modified as recent as the Date is weak: no match.
        h.insert(header::DATE, HeaderValue::from_static(lm));
        assert!(!if_range_matches(lm, &h));
    }

    #[test]
    fn boundaries_avoid_the_body() {
        let body = Bytes::from_static(b"0123456789");
        let b = boundary_for(&body);
        assert!(b.starts_with("braid-proxy-") && !contains(&body, b.as_bytes()));
        assert!(contains(b"abcdef", b"cde") && !contains(b"abc", b"abcd"));
    }
}
