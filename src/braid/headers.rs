//! Version ids, version lists and the Braid request header parsers.

use std::fmt::{self, Write};
use std::time::Duration;

/// Longest version id accepted, in bytes.
pub const MAX_VERSION_ID_LEN: usize = 256;
/// Most ids in one `Version` or `Parents` header.
pub const MAX_VERSIONS: usize = 64;

/// A malformed Braid header; the message names the header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {header} header: {reason}")]
pub struct HeaderError {
    pub header: &'static str,
    pub reason: String,
}

fn err(header: &'static str, reason: impl Into<String>) -> HeaderError {
    HeaderError {
        header,
        reason: reason.into(),
    }
}

/// A version id: any string without control characters, up to 256 bytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VersionId(String);

impl VersionId {
    pub fn new(s: impl Into<String>) -> Result<VersionId, HeaderError> {
        let s = s.into();
        if s.len() > MAX_VERSION_ID_LEN {
            return Err(err(
                "Version",
                format!("a version id is longer than {MAX_VERSION_ID_LEN} bytes"),
            ));
        }
        if s.chars().any(|c| c.is_control()) {
            return Err(err("Version", "a version id holds a control character"));
        }
        Ok(VersionId(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Formats as a JSON string literal in ASCII (`\uXXXX` for the rest).
impl fmt::Display for VersionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                ' '..='~' => f.write_char(c)?,
                _ => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        write!(f, "\\u{unit:04x}")?;
                    }
                }
            }
        }
        f.write_char('"')
    }
}

/// A set of version ids, kept sorted and without duplicates.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct VersionList(Vec<VersionId>);

impl VersionList {
    pub fn new(mut ids: Vec<VersionId>) -> VersionList {
        ids.sort();
        ids.dedup();
        VersionList(ids)
    }

    pub fn single(id: VersionId) -> VersionList {
        VersionList(vec![id])
    }

    /// Parses a header value: JSON string literals separated by commas.
    pub fn parse(value: &[u8]) -> Result<VersionList, HeaderError> {
        Self::parse_named(value, "Parents")
    }

    /// As [`VersionList::parse`], naming `header` in errors.
    pub fn parse_named(value: &[u8], header: &'static str) -> Result<VersionList, HeaderError> {
        let text = std::str::from_utf8(value).map_err(|_| err(header, "not ASCII"))?;
        if text.trim().is_empty() {
            return Ok(VersionList::default());
        }
        let parsed: Vec<serde_json::Value> =
            serde_json::from_str(&format!("[{text}]")).map_err(|_| {
                err(
                    header,
                    "expected quoted version ids separated by commas, like \"v1\", \"v2\"",
                )
            })?;
        if parsed.len() > MAX_VERSIONS {
            return Err(err(header, format!("more than {MAX_VERSIONS} versions")));
        }
        let ids = parsed
            .into_iter()
            .map(|v| match v {
                serde_json::Value::String(s) => {
                    VersionId::new(s).map_err(|e| err(header, e.reason))
                }
                _ => Err(err(header, "every version must be a quoted string")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VersionList::new(ids))
    }

    /// The header value: ids as JSON literals, sorted, joined with `", "`.
    pub fn to_header_value(&self) -> String {
        let mut out = String::new();
        for (i, id) in self.0.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(out, "{id}");
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &VersionId> {
        self.0.iter()
    }

    pub fn first(&self) -> Option<&VersionId> {
        self.0.first()
    }

    pub fn contains(&self, id: &VersionId) -> bool {
        self.0.binary_search(id).is_ok()
    }
}

/// `Subscribe`: `stream` (the November 2026 subscriptions draft), `true`,
/// `?1` or blank subscribe; `false` or `?0` do not.
pub fn parse_subscribe(value: &[u8]) -> Result<bool, HeaderError> {
    let text = std::str::from_utf8(value)
        .map_err(|_| err("Subscribe", "not ASCII"))?
        .trim();
    match text {
        "" | "?1" => Ok(true),
        "?0" => Ok(false),
        t if is_stream(t.as_bytes()) || t.eq_ignore_ascii_case("true") => Ok(true),
        t if t.eq_ignore_ascii_case("false") => Ok(false),
        _ => Err(err("Subscribe", "expected stream, true, false, ?1 or ?0")),
    }
}

/// Whether a `Subscribe` value is the drafts' `stream` (any case, spaces
/// around it allowed).
pub fn is_stream(value: &[u8]) -> bool {
    value.trim_ascii().eq_ignore_ascii_case(b"stream")
}

/// `Heartbeats`: `5s`, `5`, `0.5s` or `500ms`, at most a day. Zero or
/// negative (braidify accepts `-1.9s`) means none: `Duration::ZERO`.
pub fn parse_heartbeats(value: &[u8]) -> Result<Duration, HeaderError> {
    let text = std::str::from_utf8(value)
        .map_err(|_| err("Heartbeats", "not ASCII"))?
        .trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        (text, 1.0)
    };
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| err("Heartbeats", "expected a number of seconds, like 5s"))?;
    let secs = (n * scale).max(0.0);
    if !secs.is_finite() || secs > 86_400.0 {
        return Err(err("Heartbeats", "out of range (0 to 86400 seconds)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The shortest heartbeat interval the proxy sends, or asks an upstream for.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(10);
/// The longest heartbeat interval the proxy sends, or asks an upstream for.
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(3600);

/// A client's `Heartbeats` as it may go to an upstream: within
/// [`MIN_HEARTBEAT`] and [`MAX_HEARTBEAT`], in seconds (`0.01s`), the value
/// itself when already within them; `None` when it asks for none (`0`) or
/// does not parse (the proxy answers such a request 400 itself). So a
/// client cannot have an upstream send heartbeats every microsecond for
/// it (a braid-http server runs `setInterval` with the value it gets).
pub fn heartbeats_upstream(value: &http::HeaderValue) -> Option<http::HeaderValue> {
    let asked = parse_heartbeats(value.as_bytes()).ok()?;
    if asked.is_zero() {
        return None;
    }
    if (MIN_HEARTBEAT..=MAX_HEARTBEAT).contains(&asked) {
        return Some(value.clone());
    }
    let clamped = asked.clamp(MIN_HEARTBEAT, MAX_HEARTBEAT);
    http::HeaderValue::from_str(&format!("{}s", clamped.as_secs_f64())).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_go_upstream_within_the_proxys_bounds() {
        let up = |v: &'static str| {
            heartbeats_upstream(&http::HeaderValue::from_static(v))
                .map(|v| v.to_str().unwrap().to_string())
        };
        assert_eq!(up("0.001").as_deref(), Some("0.01s"));
        assert_eq!(up("1ms").as_deref(), Some("0.01s"));
        assert_eq!(up("86400").as_deref(), Some("3600s"));
        assert_eq!(up("5s").as_deref(), Some("5s"));
        assert_eq!(up("0"), None);
        assert_eq!(up("soon"), None);
        let floor = parse_heartbeats(up("0.0000001").unwrap().as_bytes()).unwrap();
        assert_eq!(floor, MIN_HEARTBEAT);
    }

    #[test]
    fn version_lists_round_trip_sorted() {
        let list = VersionList::parse(br#""b", "a" , "\u00e9""#).unwrap();
        assert_eq!(list.to_header_value(), r#""a", "b", "\u00e9""#);
        assert!(VersionList::parse(b"").unwrap().is_empty());
    }

    #[test]
    fn bad_version_lists_name_the_header() {
        for bad in [
            &b"v1"[..],
            b"\"a\" \"b\"",
            b"1",
            br#""a\nb""#,
            b"\"unterminated",
        ] {
            let e = VersionList::parse_named(bad, "Parents").unwrap_err();
            assert_eq!(e.header, "Parents", "{bad:?}");
            assert!(e.to_string().starts_with("malformed Parents header"), "{e}");
        }
    }

    #[test]
    fn astral_ids_are_escaped_as_surrogates() {
        let id = VersionId::new("x😀\"").unwrap();
        assert_eq!(id.to_string(), r#""x\ud83d\ude00\"""#);
    }

    #[test]
    fn subscribe_and_heartbeats() {
        assert_eq!(parse_subscribe(b"true"), Ok(true));
        assert_eq!(parse_subscribe(b"?1"), Ok(true));
        assert_eq!(parse_subscribe(b""), Ok(true));
        assert_eq!(parse_subscribe(b"false"), Ok(false));
        assert_eq!(parse_subscribe(b"stream"), Ok(true));
        assert_eq!(parse_subscribe(b" Stream "), Ok(true));
        assert!(is_stream(b"STREAM") && !is_stream(b"true") && !is_stream(b"streams"));
        assert!(parse_subscribe(b"yes").is_err());
        assert!(parse_subscribe(b"stream, true").is_err());
        assert_eq!(parse_heartbeats(b"5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_heartbeats(b"2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_heartbeats(b"500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_heartbeats(b"abc").is_err());
        assert_eq!(parse_heartbeats(b"-1.9s"), Ok(Duration::ZERO));
        assert_eq!(parse_heartbeats(b"0.25s"), Ok(Duration::from_millis(250)));
    }
}
