//! RFC 9111 decisions for a shared cache, as pure functions: may a response
//! be stored, for how long is it fresh, how old is it, may a stored response
//! answer a request, and which request headers select its variant. Nothing
//! here touches a socket; `router` and `upstream` act on the answers.

use std::time::{Duration, SystemTime};

use http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

/// Longest lifetime the proxy gives a response by heuristic (RFC 9111 §4.2.2).
pub const MAX_HEURISTIC: Duration = Duration::from_secs(24 * 3600);

/// The directives of a `Cache-Control` header section that matter here.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheControl {
    pub no_store: bool,
    pub no_cache: bool,
    /// `private`, also with field names (treated as the whole response).
    pub private: bool,
    pub public: bool,
    pub must_revalidate: bool,
    pub proxy_revalidate: bool,
    pub only_if_cached: bool,
    pub must_understand: bool,
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
    /// `max-stale` without a value is `Some(u64::MAX)`.
    pub max_stale: Option<u64>,
    pub min_fresh: Option<u64>,
    pub no_transform: bool,
    /// `stale-while-revalidate=N` (RFC 5861 §3), in a response.
    pub stale_while_revalidate: Option<u64>,
    /// `stale-if-error=N` (RFC 5861 §4), in a response or a request.
    pub stale_if_error: Option<u64>,
}

impl CacheControl {
    /// Parses every `Cache-Control` line of `headers`. A malformed argument
    /// makes the directive count as its most conservative form.
    pub fn parse(headers: &HeaderMap) -> CacheControl {
        let mut cc = CacheControl::default();
        for line in headers.get_all(header::CACHE_CONTROL) {
            let Ok(line) = line.to_str() else { continue };
            for directive in split_list(line) {
                let (name, arg) = match directive.split_once('=') {
                    // `max-age = 5` is not a directive of this grammar: ignored.
                    Some((n, a)) if n.ends_with(' ') || a.starts_with(' ') => continue,
                    Some((n, a)) => (n.trim(), Some(a.trim().trim_matches('"'))),
                    None => (directive.trim(), None),
                };
                let seconds = || arg.and_then(parse_seconds);
                match name.to_ascii_lowercase().as_str() {
                    "no-store" => cc.no_store = true,
                    "no-cache" => cc.no_cache = true,
                    "private" => cc.private = true,
                    "public" => cc.public = true,
                    "must-revalidate" => cc.must_revalidate = true,
                    "proxy-revalidate" => cc.proxy_revalidate = true,
                    "only-if-cached" => cc.only_if_cached = true,
                    "must-understand" => cc.must_understand = true,
                    "no-transform" => cc.no_transform = true,
                    // The first of duplicate directives is used (§4.2.1);
                    // one whose argument is not a number is ignored.
                    "max-age" => cc.max_age = cc.max_age.or_else(seconds),
                    "s-maxage" => cc.s_maxage = cc.s_maxage.or_else(seconds),
                    "max-stale" => cc.max_stale = Some(seconds().unwrap_or(u64::MAX)),
                    "min-fresh" => cc.min_fresh = Some(seconds().unwrap_or(0)),
                    // Without a valid number, RFC 5861's extensions grant nothing.
                    "stale-while-revalidate" => {
                        cc.stale_while_revalidate = cc.stale_while_revalidate.or_else(seconds)
                    }
                    "stale-if-error" => cc.stale_if_error = cc.stale_if_error.or_else(seconds),
                    _ => {}
                }
            }
        }
        cc
    }
}

/// A directive's seconds: delta-seconds, or its integer part when written
/// with a fraction (`3600.0`).
fn parse_seconds(s: &str) -> Option<u64> {
    match s.split_once('.') {
        Some((whole, fraction)) if fraction.bytes().all(|b| b.is_ascii_digit()) => {
            parse_delta(whole)
        }
        Some(_) => None,
        None => parse_delta(s),
    }
}

/// A delta-seconds value; too large a value is the largest (§1.2.2).
fn parse_delta(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse::<u64>().unwrap_or(u64::from(u32::MAX)))
}

/// Splits a comma-separated list, keeping commas inside quoted strings.
fn split_list(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(line[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(line[start..].trim());
    out.retain(|s| !s.is_empty());
    out
}

/// Status codes a cache may reuse without explicit freshness (RFC 9110 §15.1).
pub fn heuristically_cacheable(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200 | 203 | 204 | 206 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501
    )
}

/// Status codes the proxy stores: final, and neither partial content
/// (ranges are not implemented) nor a 304.
fn understood(status: StatusCode) -> bool {
    status.as_u16() >= 200 && !matches!(status.as_u16(), 206 | 304)
}

/// Status codes RFC 9110 defines (§15), for `must-understand` (RFC 9111 §5.2.2.3).
fn defined(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200..=206 | 300..=305 | 307 | 308 | 400..=417 | 421 | 422 | 426 | 500..=505
    )
}

/// Why a response may not be stored for reuse by other requests, or `None`
/// when it may (RFC 9111 §3 for a shared cache). `credentials` is whether
/// the request carried `Authorization` (§3.5).
pub fn unstorable(
    request: &CacheControl,
    status: StatusCode,
    headers: &HeaderMap,
    credentials: bool,
) -> Option<&'static str> {
    let cc = response_cache_control(headers);
    if !understood(status) {
        return Some("status");
    }
    if matches!(status.as_u16(), 309 | 432) {
        // The version asked for is unknown there (yet): Braid's answer
        // for now, not one to reuse.
        return Some("version unknown here");
    }
    if cc.must_understand && !defined(status) {
        return Some("must-understand");
    }
    if request.no_store {
        return Some("request no-store");
    }
    if cc.no_store {
        return Some("no-store");
    }
    if cc.private {
        return Some("private");
    }
    if headers.contains_key(header::SET_COOKIE) {
        return Some("set-cookie");
    }
    if credentials && !(cc.public || cc.s_maxage.is_some() || cc.must_revalidate) {
        return Some("authorization");
    }
    if matches!(vary(headers), Vary::Any) {
        return Some("vary *");
    }
    let explicit = cc.public
        || cc.max_age.is_some()
        || cc.s_maxage.is_some()
        || headers.contains_key(header::EXPIRES);
    if !explicit && !heuristically_cacheable(status) {
        return Some("not cacheable by default");
    }
    None
}

/// The age given to a response whose `Age` is invalid: older than any lifetime.
const INVALID_AGE: u64 = u64::MAX / 4;

/// The timing facts of a stored response, for its age (RFC 9111 §4.2.3).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// When the request that got it was sent.
    pub request_time: SystemTime,
    /// When its headers arrived.
    pub response_time: SystemTime,
}

#[cfg(test)]
impl Timing {
    fn now() -> Timing {
        let now = SystemTime::now();
        Timing {
            request_time: now,
            response_time: now,
        }
    }
}

fn date_header(headers: &HeaderMap, name: HeaderName) -> Option<SystemTime> {
    let mut lines = headers.get_all(name).iter();
    let first = lines.next()?.to_str().ok()?;
    parse_date(first)
}

/// Parses an HTTP date leniently, as deployed caches do: IMF-fixdate,
/// RFC 850 and asctime forms, with any case, a wrong or missing weekday,
/// extra spaces, dashes, a zone other than GMT (read as GMT), two-digit
/// years (RFC 9110 §5.6.7) and one-digit hours.
pub fn parse_date(text: &str) -> Option<SystemTime> {
    if let Ok(t) = httpdate::parse_http_date(text.trim()) {
        return Some(t);
    }
    const MONTHS: [&str; 12] = [
        "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
    ];
    let (mut day, mut month, mut year, mut time) = (None, None, None, None);
    for token in text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '-')
        .filter(|t| !t.is_empty())
    {
        let lower = token.to_ascii_lowercase();
        if token.contains(':') || (token.contains('.') && token.len() >= 5) {
            let parts: Vec<u64> = token
                .split([':', '.'])
                .map(|p| p.parse().ok())
                .collect::<Option<_>>()?;
            if parts.len() != 3 || parts[0] > 23 || parts[1] > 59 || parts[2] > 60 {
                return None;
            }
            time = Some(parts[0] * 3600 + parts[1] * 60 + parts[2]);
        } else if token.bytes().all(|b| b.is_ascii_digit()) {
            let n: u64 = token.parse().ok()?;
            match (token.len(), day) {
                (1 | 2, None) => day = Some(n),
                (2, Some(_)) => year = Some(n + if n < 70 { 2000 } else { 1900 }),
                (4, _) => year = Some(n),
                _ => return None,
            }
        } else if let Some(m) = MONTHS.iter().position(|m| lower == *m) {
            month = Some(m as u64 + 1);
        }
    }
    let (day, month, year, time) = (day?, month?, year?, time?);
    if !(1..=31).contains(&day) || year < 1970 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(days * 86_400 + time))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (year >= 1970).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn secs(d: Duration) -> u64 {
    d.as_secs()
}

/// The current age of a stored response, in seconds (RFC 9111 §4.2.3).
/// An `Age` that is not one line of delta-seconds makes the response
/// stale (RFC 9111 §5.1).
pub fn current_age(headers: &HeaderMap, timing: Timing, now: SystemTime) -> u64 {
    let mut lines = headers.get_all(header::AGE).iter();
    let age_value = match (lines.next(), lines.next()) {
        (None, _) => 0,
        (Some(v), None) => match v.to_str().ok().and_then(|s| parse_delta(s.trim())) {
            Some(age) => age,
            None => return INVALID_AGE,
        },
        (Some(_), Some(_)) => return INVALID_AGE,
    };
    let date = date_header(headers, header::DATE).unwrap_or(timing.response_time);
    let apparent = timing
        .response_time
        .duration_since(date)
        .map(secs)
        .unwrap_or(0);
    let delay = timing
        .response_time
        .duration_since(timing.request_time)
        .map(secs)
        .unwrap_or(0);
    let corrected_initial = apparent.max(age_value.saturating_add(delay));
    let resident = now
        .duration_since(timing.response_time)
        .map(secs)
        .unwrap_or(0);
    corrected_initial.saturating_add(resident)
}

/// The freshness lifetime of a response for a shared cache, in seconds
/// (RFC 9111 §4.2.1), with the heuristic of §4.2.2 where none is given.
pub fn freshness_lifetime(status: StatusCode, headers: &HeaderMap, timing: Timing) -> u64 {
    let cc = response_cache_control(headers);
    if let Some(s) = cc.s_maxage {
        return s;
    }
    if let Some(s) = cc.max_age {
        return s;
    }
    let date = date_header(headers, header::DATE).unwrap_or(timing.response_time);
    if headers.contains_key(header::EXPIRES) {
        // An invalid Expires (such as "0") means already expired.
        return match date_header(headers, header::EXPIRES) {
            Some(expires) => expires.duration_since(date).map(secs).unwrap_or(0),
            None => 0,
        };
    }
    if cc.public || heuristically_cacheable(status) {
        if let Some(modified) = date_header(headers, header::LAST_MODIFIED) {
            let since = date.duration_since(modified).unwrap_or_default();
            return secs((since / 10).min(MAX_HEURISTIC));
        }
    }
    0
}

/// Whether a stored response may answer a request without going to the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Fresh enough for this request: serve it (`ttl` seconds left).
    Fresh { ttl: i64 },
    /// It must be revalidated first.
    Revalidate,
}

/// Decides whether a stored response (its headers and timing) may answer a
/// request with the given `Cache-Control` (RFC 9111 §4.2, §5.2.1).
pub fn reuse(
    status: StatusCode,
    headers: &HeaderMap,
    timing: Timing,
    request: &CacheControl,
    now: SystemTime,
) -> Reuse {
    reuse_known(&Freshness::of(status, headers, timing), request, now)
}

/// What a stored response's own status, headers and timing say for
/// [`reuse`]: the same for every request, so computed once per stored
/// answer (`Stored::reuse`).
#[derive(Debug, Clone)]
pub struct Freshness {
    /// Its caching directives ([`response_cache_control`]).
    pub cc: CacheControl,
    /// [`freshness_lifetime`].
    pub lifetime: u64,
    /// [`current_age`] when it arrived, and whether it stays so (an
    /// invalid `Age`).
    initial_age: u64,
    age_fixed: bool,
    response_time: SystemTime,
}

impl Freshness {
    pub fn of(status: StatusCode, headers: &HeaderMap, timing: Timing) -> Freshness {
        let arrived = timing.response_time;
        let initial_age = current_age(headers, timing, arrived);
        // Only the age an invalid `Age` gives does not grow.
        let later = current_age(headers, timing, arrived + Duration::from_secs(1));
        Freshness {
            cc: response_cache_control(headers),
            lifetime: freshness_lifetime(status, headers, timing),
            initial_age,
            age_fixed: later == initial_age,
            response_time: arrived,
        }
    }

    /// [`current_age`] at `now`.
    pub fn age(&self, now: SystemTime) -> u64 {
        if self.age_fixed {
            return self.initial_age;
        }
        let resident = now
            .duration_since(self.response_time)
            .map(secs)
            .unwrap_or(0);
        self.initial_age.saturating_add(resident)
    }
}

/// [`reuse`] with the stored response's side known.
pub fn reuse_known(stored: &Freshness, request: &CacheControl, now: SystemTime) -> Reuse {
    let cc = &stored.cc;
    if cc.no_cache || request.no_cache {
        return Reuse::Revalidate;
    }
    let lifetime = stored.lifetime;
    let age = stored.age(now);
    let ttl = lifetime as i64 - age as i64;
    if let Some(max_age) = request.max_age {
        if age > max_age {
            return Reuse::Revalidate;
        }
    }
    if let Some(min_fresh) = request.min_fresh {
        if ttl < min_fresh as i64 {
            return Reuse::Revalidate;
        }
    }
    if ttl > 0 {
        return Reuse::Fresh { ttl };
    }
    // Stale: only a client's max-stale allows it, never past must-revalidate.
    let strict = cc.must_revalidate || cc.proxy_revalidate || cc.s_maxage.is_some();
    match request.max_stale {
        Some(allowed) if !strict && (-ttl) as u64 <= allowed => Reuse::Fresh { ttl },
        _ => Reuse::Revalidate,
    }
}

/// Whether the response's own directives allow serving it stale at all
/// (RFC 9111 §4.2.4): never under `no-cache`, `must-revalidate`,
/// `proxy-revalidate` or `s-maxage` (which implies `proxy-revalidate` for a
/// shared cache, §5.2.2.10).
fn may_serve_stale(cc: &CacheControl) -> bool {
    !(cc.no_cache || cc.must_revalidate || cc.proxy_revalidate || cc.s_maxage.is_some())
}

/// Seconds of freshness left (negative once stale), saturating.
fn ttl_of(status: StatusCode, headers: &HeaderMap, timing: Timing, now: SystemTime) -> i64 {
    let lifetime = i64::try_from(freshness_lifetime(status, headers, timing)).unwrap_or(i64::MAX);
    let age = i64::try_from(current_age(headers, timing, now)).unwrap_or(i64::MAX);
    lifetime.saturating_sub(age)
}

/// Whether a stored response that [`reuse`] says must be revalidated may
/// answer at once while one revalidation runs in the background (RFC 5861
/// §3): it is stale by at most its `stale-while-revalidate` seconds, its
/// directives allow stale answers, and the request asks for nothing
/// fresher (`no-cache`, `max-age`, `min-fresh`). Gives its ttl (<= 0).
pub fn stale_while_revalidate(
    status: StatusCode,
    headers: &HeaderMap,
    timing: Timing,
    request: &CacheControl,
    now: SystemTime,
) -> Option<i64> {
    let cc = response_cache_control(headers);
    let window = cc.stale_while_revalidate.filter(|w| *w > 0)?;
    if !may_serve_stale(&cc) || request.no_cache || request.min_fresh.is_some() {
        return None;
    }
    if let Some(max_age) = request.max_age {
        if current_age(headers, timing, now) > max_age {
            return None;
        }
    }
    let ttl = ttl_of(status, headers, timing, now);
    (ttl.unsigned_abs() <= window).then_some(ttl.min(0))
}

/// Whether a stored response may answer instead of an origin's error (a
/// 500, 502, 503 or 504, a failed connection or a timeout; RFC 5861 §4):
/// within the request's `stale-if-error` seconds past its freshness, else
/// the response's, else `default` (the operator's `--stale-if-error`) when
/// neither names one; never when its directives forbid stale answers, nor
/// for a request with `no-cache` that names no `stale-if-error`. Gives its
/// ttl (negative once stale).
pub fn stale_if_error(
    status: StatusCode,
    headers: &HeaderMap,
    timing: Timing,
    request: &CacheControl,
    default: u64,
    now: SystemTime,
) -> Option<i64> {
    let cc = response_cache_control(headers);
    if !may_serve_stale(&cc) || (request.no_cache && request.stale_if_error.is_none()) {
        return None;
    }
    let window = request
        .stale_if_error
        .or(cc.stale_if_error)
        .unwrap_or(default);
    if window == 0 {
        return None;
    }
    let ttl = ttl_of(status, headers, timing, now);
    (ttl > 0 || ttl.unsigned_abs() <= window).then_some(ttl)
}

/// The origin errors `stale-if-error` covers (RFC 5861 §4).
pub fn is_origin_error(status: StatusCode) -> bool {
    matches!(status.as_u16(), 500 | 502 | 503 | 504)
}

/// A request's `Cache-Control`. `Pragma` is deprecated (RFC 9111 §5.4)
/// and not read.
pub fn request_cache_control(headers: &HeaderMap) -> CacheControl {
    CacheControl::parse(headers)
}

/// The device token this proxy answers to in `Surrogate-Control` targets,
/// and advertises in `Surrogate-Capability` (W3C Edge Architecture 1.0).
pub const SURROGATE_TARGET: &str = "braid-proxy";

/// The `Surrogate-Capability` value sent upstream.
pub const SURROGATE_CAPABILITY: &str = "braid-proxy=\"Surrogate/1.0\"";

/// A response's caching directives for this proxy: its `Cache-Control`,
/// where `Surrogate-Control` directives meant for this proxy (untargeted,
/// or targeted at [`SURROGATE_TARGET`]) replace the lifetime and storage
/// ones: a reverse proxy is the surrogate the origin addresses.
pub fn response_cache_control(headers: &HeaderMap) -> CacheControl {
    let mut cc = CacheControl::parse(headers);
    let (mut max_age, mut no_store, mut seen) = (None, false, false);
    for line in headers.get_all("surrogate-control") {
        let Ok(line) = line.to_str() else { continue };
        for directive in split_list(line) {
            let (directive, target) = match directive.split_once(';') {
                Some((d, t)) => (d.trim(), Some(t.trim())),
                None => (directive, None),
            };
            if target.is_some_and(|t| t != SURROGATE_TARGET) {
                continue;
            }
            let (name, arg) = match directive.split_once('=') {
                Some((n, a)) if n.ends_with(' ') || a.starts_with(' ') => continue,
                Some((n, a)) => (n, Some(a.trim_matches('"'))),
                None => (directive, None),
            };
            match name.to_ascii_lowercase().as_str() {
                "max-age" => {
                    if let Some(secs) = arg.and_then(parse_seconds) {
                        max_age = max_age.or(Some(secs));
                        seen = true;
                    }
                }
                "no-store" => {
                    no_store = true;
                    seen = true;
                }
                _ => {}
            }
        }
    }
    if seen {
        cc.no_store = no_store;
        cc.max_age = max_age;
        cc.s_maxage = None;
        cc.no_cache = false;
        cc.must_revalidate = false;
        cc.proxy_revalidate = false;
    }
    cc
}

/// The response's `Vary`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Vary {
    /// The named request headers select the variant (lowercase, sorted, unique).
    #[default]
    None,
    Names(Vec<HeaderName>),
    /// `Vary: *`: never reused.
    Any,
}

/// Reads the `Vary` lines of a response.
pub fn vary(headers: &HeaderMap) -> Vary {
    let mut names = Vec::new();
    for line in headers.get_all(header::VARY) {
        let Ok(line) = line.to_str() else {
            return Vary::Any;
        };
        for name in line.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return Vary::Any;
            }
            match HeaderName::from_bytes(name.as_bytes()) {
                Ok(n) => names.push(n),
                Err(_) => return Vary::Any,
            }
        }
    }
    names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    names.dedup();
    if names.is_empty() {
        Vary::None
    } else {
        Vary::Names(names)
    }
}

/// The secondary key of a request: the forwarded host, the values of the
/// headers `vary` names, byte for byte as the client sent them (an origin
/// may tell `a b` from `a  b`, and any two byte strings apart), and a
/// digest of its credentials. Two requests with equal keys get the same
/// answer. Each value's bytes are written by [`push_exact`], at most three
/// key bytes per header byte, so a key stays within three times
/// `--max-header-bytes`; its length is counted with the resource.
pub fn secondary_key(headers: &HeaderMap, host: &str, vary: &Vary) -> String {
    let mut key = String::from(host);
    if let Vary::Names(names) = vary {
        for name in names {
            key.push('\n');
            key.push_str(name.as_str());
            key.push(':');
            push_field(&mut key, name.as_str(), headers.get_all(name));
        }
    }
    if let Some(digest) = credentials_digest(headers) {
        key.push_str("\ncredentials:");
        key.push_str(&digest);
    }
    key
}

/// Appends the lines of one request header `name` to a key, each byte for
/// byte ([`push_exact`]), joined by `, `: the one line any recipient may
/// make of them without changing what they mean (RFC 9110 §5.3), so `a`
/// and `b` on two lines key as `a, b` on one, and as nothing else. The
/// `Accept` headers, whose grammar is a list (RFC 9110 §12.5), are keyed
/// by their members: the optional whitespace around their commas is no
/// part of any member (`en, de` is ` en ,   de`); nothing else is changed.
pub fn push_field(key: &mut String, name: &str, lines: http::header::GetAll<'_, HeaderValue>) {
    let list = matches!(
        name,
        "accept" | "accept-charset" | "accept-encoding" | "accept-language"
    );
    let mut first = true;
    for v in lines.iter() {
        if !list {
            if !first {
                key.push_str(", ");
            }
            first = false;
            push_exact(key, v.as_bytes());
            continue;
        }
        for member in v.as_bytes().split(|b| *b == b',') {
            if !first {
                key.push_str(", ");
            }
            first = false;
            push_exact(key, member.trim_ascii());
        }
    }
}

/// Appends `value` to a key so that two different byte strings never
/// append the same text: visible ASCII and space as they are, `%` and
/// every other byte (tab, bytes that are not ASCII) as `%XX`.
pub fn push_exact(key: &mut String, value: &[u8]) {
    use std::fmt::Write as _;
    for &b in value {
        if b == b' ' || (b.is_ascii_graphic() && b != b'%') {
            key.push(b as char);
        } else {
            let _ = write!(key, "%{b:02X}");
        }
    }
}

/// A digest of the request's `Authorization` and `Cookie` values, if any:
/// the part of a key that keeps one user's state from another's.
pub fn credentials_digest(headers: &HeaderMap) -> Option<String> {
    if !has_credentials(headers) {
        return None;
    }
    let mut hasher = Sha256::new();
    for name in [header::AUTHORIZATION, header::COOKIE] {
        for v in headers.get_all(&name) {
            hasher.update(name.as_str());
            hasher.update(b"\0");
            hasher.update(v.as_bytes());
            hasher.update(b"\0");
        }
    }
    let hash = hasher.finalize();
    Some(hash.iter().take(16).map(|b| format!("{b:02x}")).collect())
}

/// Whether a request carries credentials.
pub fn has_credentials(headers: &HeaderMap) -> bool {
    headers.contains_key(header::AUTHORIZATION) || headers.contains_key(header::COOKIE)
}

/// Weak comparison of entity tags (RFC 9110 §8.8.3.2): equal opaque tags,
/// whatever their `W/` prefixes.
pub fn weak_match(a: &str, b: &str) -> bool {
    let opaque = |t: &str| t.trim().trim_start_matches("W/").to_string();
    let (a, b) = (opaque(a), opaque(b));
    a.starts_with('"') && a.len() >= 2 && a == b
}

/// Whether `If-None-Match` (a list, or `*`) matches the stored `etag`.
pub fn if_none_match(value: &str, etag: Option<&str>) -> bool {
    split_list(value)
        .into_iter()
        .any(|tag| tag == "*" || etag.is_some_and(|e| weak_match(tag, e)))
}

/// Whether a stored response with `last_modified` is unmodified since
/// `if_modified_since` (RFC 9110 §13.1.3). Invalid dates never match.
pub fn not_modified_since(last_modified: Option<&HeaderValue>, if_modified_since: &str) -> bool {
    let (Some(lm), Ok(since)) = (
        last_modified
            .and_then(|v| v.to_str().ok())
            .and_then(|v| httpdate::parse_http_date(v).ok()),
        httpdate::parse_http_date(if_modified_since.trim()),
    ) else {
        return false;
    };
    lm <= since
}

/// The end-to-end headers of a response, as a cache stores them.
pub fn stored_headers(headers: &HeaderMap) -> HeaderMap {
    let mut out = crate::floor::headers::owned_headers(headers);
    crate::floor::headers::strip_hop_by_hop(&mut out);
    out.remove(header::CONTENT_LENGTH);
    out
}

/// The `Last-Modified` of an answer when it is a strong validator (RFC 9110
/// §8.8.2.2): the answer's own `Date` is at least one second after it. A
/// modification time within the second of the answer (or an answer without
/// a `Date`) may name two bodies written in that second, so a 304 to an
/// `If-Modified-Since` with it would prove nothing: `None`, and the
/// resource is fetched in full (its body's hash tells whether it changed).
pub fn strong_last_modified(headers: &HeaderMap) -> Option<&HeaderValue> {
    let value = headers.get(header::LAST_MODIFIED)?;
    let modified = date_header(headers, header::LAST_MODIFIED)?;
    let date = date_header(headers, header::DATE)?;
    let after = date.duration_since(modified).ok()?;
    (after >= Duration::from_secs(1)).then_some(value)
}

/// The validators a cache revalidates a stored answer with, from its
/// headers: its `ETag` (an origin's weak one still names a representation
/// it calls equivalent), and its `Last-Modified` only where it is strong
/// ([`strong_last_modified`]). `(None, None)`: ask unconditionally.
pub fn revalidation_validators(stored: &HeaderMap) -> (Option<HeaderValue>, Option<HeaderValue>) {
    (
        stored.get(header::ETAG).cloned(),
        strong_last_modified(stored).cloned(),
    )
}

/// Whether a 304 is about the stored answer whose headers are `stored`
/// (RFC 9111 §4.3.4): the request asked with the stored answer's validator
/// (`etag` sent in `If-None-Match`, else `modified` in `If-Modified-Since`),
/// and the 304's own strong validator, when it gives one, is the stored one.
pub fn not_modified_applies(
    stored: &HeaderMap,
    etag: Option<&HeaderValue>,
    modified: Option<&HeaderValue>,
    answer: &HeaderMap,
) -> bool {
    let stored_etag = stored.get(header::ETAG);
    let asked = match (etag, modified) {
        (Some(etag), _) => stored_etag == Some(etag),
        (None, Some(date)) => stored.get(header::LAST_MODIFIED) == Some(date),
        (None, None) => false,
    };
    let named = answer.get(header::ETAG);
    asked && (named.is_none() || named == stored_etag)
}

/// Whether a `200` to a HEAD may update the stored answer to a GET (RFC
/// 9111 §4.3.5): every validator it carries (`ETag`, `Last-Modified`)
/// equals the stored one, and its `Content-Length`, if any, is the stored
/// body's length. Otherwise the stored answer is to be invalidated.
pub fn head_updates(stored: &HeaderMap, stored_len: usize, head: &HeaderMap) -> bool {
    let same = |name: HeaderName| match head.get(&name) {
        Some(v) => stored.get(&name) == Some(v),
        None => true,
    };
    let length = head
        .get(header::CONTENT_LENGTH)
        .map(|v| v.to_str().ok().and_then(|v| v.trim().parse::<usize>().ok()));
    same(header::ETAG)
        && same(header::LAST_MODIFIED)
        && match length {
            None => true,
            Some(n) => n == Some(stored_len),
        }
}

/// Updates stored headers with those of a 304 (RFC 9111 §4.3.4): each
/// header the 304 carries replaces the stored one, except the framing ones.
pub fn merge_not_modified(stored: &HeaderMap, update: &HeaderMap) -> HeaderMap {
    let mut out = stored.clone();
    let fresh = stored_headers(update);
    for name in fresh.keys() {
        // Fields the stored body depends on stay as stored (RFC 9111 §3.2).
        if matches!(
            name.as_str(),
            "content-encoding" | "content-range" | "content-md5" | "etag"
        ) {
            continue;
        }
        out.remove(name);
        for v in fresh.get_all(name) {
            out.append(name.clone(), v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_modified_is_strong_a_second_before_the_date() {
        let with = |modified: &str, date: Option<&str>| {
            let mut h = HeaderMap::new();
            h.insert(
                header::LAST_MODIFIED,
                HeaderValue::from_str(modified).unwrap(),
            );
            if let Some(date) = date {
                h.insert(header::DATE, HeaderValue::from_str(date).unwrap());
            }
            h
        };
        let lm = "Mon, 07 Dec 2026 10:00:00 GMT";
        // Same second: two writes in it share the date.
        assert!(strong_last_modified(&with(lm, Some(lm))).is_none());
        // No Date: nothing tells.
        assert!(strong_last_modified(&with(lm, None)).is_none());
        // A Date before it (clock skew) is no proof either.
        let before = "Mon, 07 Dec 2026 09:59:59 GMT";
        assert!(strong_last_modified(&with(lm, Some(before))).is_none());
        let later = "Mon, 07 Dec 2026 10:00:01 GMT";
        assert!(strong_last_modified(&with(lm, Some(later))).is_some());
        assert_eq!(
            revalidation_validators(&with(lm, Some(lm))),
            (None, None),
            "a same-second date is not sent as If-Modified-Since"
        );
        let mut tagged = with(lm, Some(lm));
        tagged.insert(header::ETAG, HeaderValue::from_static("W/\"1\""));
        assert_eq!(revalidation_validators(&tagged).1, None);
        assert!(revalidation_validators(&tagged).0.is_some());
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    fn at(secs_ago: u64) -> Timing {
        let t = SystemTime::now() - Duration::from_secs(secs_ago);
        Timing {
            request_time: t,
            response_time: t,
        }
    }

    #[test]
    fn directives_parse() {
        let cc = CacheControl::parse(&headers(&[
            ("cache-control", "public, max-age=60"),
            (
                "cache-control",
                "s-maxage=\"5\", no-cache=\"set-cookie, x\"",
            ),
        ]));
        assert!(cc.public && cc.no_cache);
        assert_eq!((cc.max_age, cc.s_maxage), (Some(60), Some(5)));
        // The first of duplicates; a bad argument or spaced `=` is ignored.
        let dup = CacheControl::parse(&headers(&[("cache-control", "max-age=60, max-age=10")]));
        assert_eq!(dup.max_age, Some(60));
        let bad = CacheControl::parse(&headers(&[("cache-control", "max-age=abc")]));
        assert_eq!(bad.max_age, None);
        let spaced = CacheControl::parse(&headers(&[("cache-control", "max-age = 60")]));
        assert_eq!(spaced.max_age, None);
        let decimal = CacheControl::parse(&headers(&[("cache-control", "max-age=60.0")]));
        assert_eq!(decimal.max_age, Some(60));
    }

    #[test]
    fn surrogate_control_addressed_to_us_wins() {
        let h = headers(&[
            ("cache-control", "no-store"),
            ("surrogate-control", "max-age=30"),
        ]);
        let cc = response_cache_control(&h);
        assert!(!cc.no_store);
        assert_eq!(cc.max_age, Some(30));
        let other = headers(&[("surrogate-control", "max-age=30;somebody-else")]);
        assert_eq!(response_cache_control(&other).max_age, None);
        let ours = headers(&[("surrogate-control", "no-store;braid-proxy")]);
        assert!(response_cache_control(&ours).no_store);
    }

    #[test]
    fn invalid_age_is_stale() {
        let t = Timing::now();
        let now = SystemTime::now();
        assert!(current_age(&headers(&[("age", "10")]), t, now) >= 10);
        for bad in ["abc", "-1", "1.5", "0, 0", "7;x=1"] {
            assert_eq!(
                current_age(&headers(&[("age", bad)]), t, now),
                INVALID_AGE,
                "{bad}"
            );
        }
        let two = headers(&[("age", "0"), ("age", "0")]);
        assert_eq!(current_age(&two, t, now), INVALID_AGE);
    }

    #[test]
    fn dates_parse_leniently() {
        let want = httpdate::parse_http_date("Thu, 18 Aug 2050 02:01:18 GMT").expect("date");
        for text in [
            "Thu, 18 Aug 2050 02:01:18 GMT",
            "THU, 18 AUG 2050 02:01:18 gmt",
            "Thursday, 18-Aug-50 02:01:18 GMT",
            "Thu 18 Aug 2050 02:01:18 UTC",
            "Thu, 18  Aug  2050 2:01:18 GMT",
            "Thu, 18 Aug 2050 02.01.18 GMT",
            "Mon, 18 Aug 2050 02:01:18 GMT",
        ] {
            assert_eq!(parse_date(text), Some(want), "{text}");
        }
        assert!(parse_date("Thu Aug 18 02:01:18 2050").is_some());
        assert_eq!(parse_date("0"), None);
        assert_eq!(parse_date("next tuesday"), None);
    }

    #[test]
    fn freshness_order_and_heuristic() {
        let now = Timing::now();
        let h = headers(&[("cache-control", "max-age=60, s-maxage=5")]);
        assert_eq!(freshness_lifetime(StatusCode::OK, &h, now), 5);
        let date = httpdate::fmt_http_date(now.response_time);
        let lm = httpdate::fmt_http_date(now.response_time - Duration::from_secs(1000));
        let h = headers(&[("date", &date), ("last-modified", &lm)]);
        assert_eq!(freshness_lifetime(StatusCode::OK, &h, now), 100);
        assert_eq!(freshness_lifetime(StatusCode::CREATED, &h, now), 0);
        let h = headers(&[("date", &date), ("expires", "0")]);
        assert_eq!(freshness_lifetime(StatusCode::OK, &h, now), 0);
    }

    #[test]
    fn reuse_rules() {
        let none = CacheControl::default();
        let h = headers(&[("cache-control", "max-age=60")]);
        assert!(matches!(
            reuse(StatusCode::OK, &h, at(10), &none, SystemTime::now()),
            Reuse::Fresh { .. }
        ));
        assert_eq!(
            reuse(StatusCode::OK, &h, at(61), &none, SystemTime::now()),
            Reuse::Revalidate
        );
        let h = headers(&[("cache-control", "max-age=60, no-cache")]);
        assert_eq!(
            reuse(StatusCode::OK, &h, at(0), &none, SystemTime::now()),
            Reuse::Revalidate
        );
        let h = headers(&[("cache-control", "max-age=60"), ("age", "50")]);
        let req = CacheControl::parse(&headers(&[("cache-control", "max-age=20")]));
        assert_eq!(
            reuse(StatusCode::OK, &h, at(0), &req, SystemTime::now()),
            Reuse::Revalidate
        );
        let stale = headers(&[("cache-control", "max-age=1")]);
        let lenient = CacheControl::parse(&headers(&[("cache-control", "max-stale=100")]));
        assert!(matches!(
            reuse(StatusCode::OK, &stale, at(10), &lenient, SystemTime::now()),
            Reuse::Fresh { .. }
        ));
        let strict = headers(&[("cache-control", "max-age=1, must-revalidate")]);
        assert_eq!(
            reuse(StatusCode::OK, &strict, at(10), &lenient, SystemTime::now()),
            Reuse::Revalidate
        );
    }

    #[test]
    fn stale_while_revalidate_window() {
        let none = CacheControl::default();
        let now = SystemTime::now();
        let h = headers(&[("cache-control", "max-age=1, stale-while-revalidate=30")]);
        let ttl = stale_while_revalidate(StatusCode::OK, &h, at(11), &none, now);
        assert!(matches!(ttl, Some(t) if (-11..=-9).contains(&t)), "{ttl:?}");
        assert_eq!(
            stale_while_revalidate(StatusCode::OK, &h, at(60), &none, now),
            None
        );
        for cc in [
            "must-revalidate",
            "proxy-revalidate",
            "no-cache",
            "s-maxage=1",
        ] {
            let strict = headers(&[(
                "cache-control",
                &format!("max-age=1, stale-while-revalidate=30, {cc}"),
            )]);
            assert_eq!(
                stale_while_revalidate(StatusCode::OK, &strict, at(11), &none, now),
                None
            );
        }
        let plain = headers(&[("cache-control", "max-age=1")]);
        assert_eq!(
            stale_while_revalidate(StatusCode::OK, &plain, at(11), &none, now),
            None
        );
        let zero = headers(&[("cache-control", "max-age=1, stale-while-revalidate=0")]);
        assert_eq!(
            stale_while_revalidate(StatusCode::OK, &zero, at(11), &none, now),
            None
        );
        let odd = headers(&[("cache-control", "max-age=1, stale-while-revalidate=soon")]);
        assert_eq!(
            stale_while_revalidate(StatusCode::OK, &odd, at(11), &none, now),
            None
        );
        for req in ["no-cache", "max-age=5", "min-fresh=1"] {
            let req = CacheControl::parse(&headers(&[("cache-control", req)]));
            assert_eq!(
                stale_while_revalidate(StatusCode::OK, &h, at(11), &req, now),
                None
            );
        }
    }

    #[test]
    fn stale_if_error_window() {
        let none = CacheControl::default();
        let now = SystemTime::now();
        let sie = |h: &HeaderMap, ago, req: &CacheControl, default| {
            stale_if_error(StatusCode::OK, h, at(ago), req, default, now)
        };
        let h = headers(&[("cache-control", "max-age=1, stale-if-error=30")]);
        assert!(sie(&h, 11, &none, 0).is_some());
        assert_eq!(sie(&h, 60, &none, 0), None);
        let plain = headers(&[("cache-control", "max-age=1")]);
        assert_eq!(sie(&plain, 11, &none, 0), None);
        // The operator's default applies only where neither side names one.
        assert!(sie(&plain, 11, &none, 60).is_some());
        assert_eq!(sie(&h, 60, &none, 3600), None);
        let asks = CacheControl::parse(&headers(&[("cache-control", "stale-if-error=100")]));
        assert!(sie(&plain, 60, &asks, 0).is_some());
        let refuses = CacheControl::parse(&headers(&[("cache-control", "stale-if-error=0")]));
        assert_eq!(sie(&h, 11, &refuses, 0), None);
        let no_cache = CacheControl::parse(&headers(&[("cache-control", "no-cache")]));
        assert_eq!(sie(&h, 11, &no_cache, 0), None);
        for cc in [
            "must-revalidate",
            "proxy-revalidate",
            "no-cache",
            "s-maxage=1",
        ] {
            let strict = headers(&[(
                "cache-control",
                &format!("max-age=1, stale-if-error=30, {cc}"),
            )]);
            assert_eq!(sie(&strict, 11, &asks, 60), None);
        }
        assert!(is_origin_error(StatusCode::SERVICE_UNAVAILABLE));
        assert!(!is_origin_error(StatusCode::NOT_FOUND));
    }

    #[test]
    fn head_answers_update_only_the_answer_they_describe() {
        let stored = headers(&[("etag", "\"a\""), ("content-type", "text/plain")]);
        assert!(head_updates(
            &stored,
            5,
            &headers(&[("cache-control", "max-age=9")])
        ));
        assert!(head_updates(
            &stored,
            5,
            &headers(&[("etag", "\"a\""), ("content-length", "5")])
        ));
        assert!(!head_updates(&stored, 5, &headers(&[("etag", "\"b\"")])));
        assert!(!head_updates(
            &stored,
            5,
            &headers(&[("content-length", "6")])
        ));
        assert!(!head_updates(
            &stored,
            5,
            &headers(&[("content-length", "x")])
        ));
        let lm = "Sat, 05 Dec 2026 10:00:00 GMT";
        assert!(!head_updates(
            &stored,
            5,
            &headers(&[("last-modified", lm)])
        ));
    }

    #[test]
    fn storability() {
        let none = CacheControl::default();
        let ok = |h: &[(&str, &str)], creds| unstorable(&none, StatusCode::OK, &headers(h), creds);
        assert_eq!(ok(&[], false), None);
        assert_eq!(ok(&[("cache-control", "private")], false), Some("private"));
        assert_eq!(
            ok(&[("cache-control", "no-store")], false),
            Some("no-store")
        );
        assert_eq!(ok(&[("set-cookie", "a=b")], false), Some("set-cookie"));
        assert_eq!(ok(&[], true), Some("authorization"));
        assert_eq!(ok(&[("cache-control", "public")], true), None);
        assert_eq!(ok(&[("vary", "*")], false), Some("vary *"));
    }

    #[test]
    fn keys_hold_a_values_exact_bytes() {
        let vary = vary(&headers(&[("vary", "X-Tenant")]));
        let key = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append("x-tenant", HeaderValue::from_bytes(v).unwrap());
            }
            secondary_key(&h, "h", &vary)
        };
        let distinct: [&[&[u8]]; 7] = [
            &[b"a b"],
            &[b"a  b"],
            &[b"\xe9vil"],
            &[b"\xe8vil"],
            &[b"a,b"],
            &[b"a, b"],
            &[b"%E9vil"],
        ];
        let keys: std::collections::HashSet<String> = distinct.iter().map(|v| key(v)).collect();
        assert_eq!(keys.len(), distinct.len(), "{keys:?}");
        // Two lines are the one line they combine into (RFC 9110 §5.3).
        assert_eq!(key(&[b"a", b"b"]), key(&[b"a, b"]));
        // A list's members, not the whitespace around its commas.
        let lang = super::vary(&headers(&[("vary", "Accept-Language")]));
        let accept =
            |v: &'static str| secondary_key(&headers(&[("accept-language", v)]), "h", &lang);
        assert_eq!(accept("en, de"), accept(" en ,   de"));
        assert_eq!(accept("en,de"), accept("en, de"));
        assert_ne!(accept("en, de"), accept("de, en"));
        assert_ne!(accept("en, de"), accept("en, de;q=0.5"));
        // Text all the same, and at most three bytes per byte.
        assert_eq!(key(&[b"\xe9vil"]), "h\nx-tenant:%E9vil");
        assert_eq!(key(&[b"a\tb"]), "h\nx-tenant:a%09b");
    }

    #[test]
    fn keys_follow_vary_and_credentials() {
        let vary = vary(&headers(&[("vary", "Accept-Language, accept")]));
        let a = headers(&[("accept-language", "en"), ("accept", "text/html")]);
        let b = headers(&[("accept-language", "fr"), ("accept", "text/html")]);
        assert_ne!(secondary_key(&a, "h", &vary), secondary_key(&b, "h", &vary));
        assert_eq!(
            secondary_key(&a, "h", &Vary::None),
            secondary_key(&b, "h", &Vary::None)
        );
        let mut c = a.clone();
        c.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        assert_ne!(secondary_key(&a, "h", &vary), secondary_key(&c, "h", &vary));
        assert_ne!(
            secondary_key(&a, "h1", &vary),
            secondary_key(&a, "h2", &vary)
        );
    }

    #[test]
    fn conditionals() {
        assert!(if_none_match("W/\"e1\"", Some("\"e1\"")));
        assert!(if_none_match("\"x\", \"e1\"", Some("W/\"e1\"")));
        assert!(!if_none_match("\"x\"", Some("\"e1\"")));
        assert!(if_none_match("*", None));
        let lm = HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT");
        assert!(not_modified_since(
            Some(&lm),
            "Wed, 02 Dec 2026 00:00:00 GMT"
        ));
        assert!(!not_modified_since(
            Some(&lm),
            "Mon, 30 Nov 2026 00:00:00 GMT"
        ));
        assert!(!not_modified_since(Some(&lm), "garbage"));
    }

    #[test]
    fn a_304_applies_only_to_the_answer_whose_validator_it_names() {
        let mut stored = HeaderMap::new();
        stored.insert(header::ETAG, HeaderValue::from_static("\"v2\""));
        stored.insert(
            header::LAST_MODIFIED,
            HeaderValue::from_static("Sun, 06 Dec 2026 10:00:00 GMT"),
        );
        let v1 = HeaderValue::from_static("\"v1\"");
        let v2 = HeaderValue::from_static("\"v2\"");
        let none = HeaderMap::new();
        let mut names_v1 = HeaderMap::new();
        names_v1.insert(header::ETAG, v1.clone());
        assert!(not_modified_applies(&stored, Some(&v2), None, &none));
        assert!(
            !not_modified_applies(&stored, Some(&v1), None, &none),
            "asked with another ETag"
        );
        assert!(
            !not_modified_applies(&stored, Some(&v2), None, &names_v1),
            "names another ETag"
        );
        let date = stored.get(header::LAST_MODIFIED).cloned();
        assert!(not_modified_applies(&stored, None, date.as_ref(), &none));
        let older = HeaderValue::from_static("Sat, 05 Dec 2026 10:00:00 GMT");
        assert!(!not_modified_applies(&stored, None, Some(&older), &none));
        assert!(
            !not_modified_applies(&stored, None, None, &none),
            "an unconditional request"
        );
    }

    #[test]
    fn not_modified_merges_headers() {
        let stored = headers(&[
            ("cache-control", "max-age=1"),
            ("x-a", "1"),
            ("content-type", "text/plain"),
        ]);
        let update = headers(&[("cache-control", "max-age=60"), ("content-length", "0")]);
        let merged = merge_not_modified(&stored, &update);
        assert_eq!(merged.get("cache-control").expect("cc"), "max-age=60");
        assert_eq!(merged.get("x-a").expect("kept"), "1");
        assert!(merged.get("content-length").is_none());
    }
}
