//! What the operator's page shows (`GET /` and `GET /status` on the admin
//! listener): the resources tracked, the upstream's health and latency,
//! the counters the page turns into rates, and memory against its caps,
//! read from the proxy's own structures at each request.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::Config;
use crate::feed::braid::Relays;
use crate::limits::OpenFiles;
use crate::metrics::Metrics;
use crate::state::{History, Kind, Registry, State};
use crate::upstream::UpstreamHealth;

/// At most this many resources are listed, the most subscribed first.
pub const MAX_LISTED: usize = 500;

/// The structures a status is read from.
pub struct Sources<'a> {
    pub config: &'a Config,
    pub metrics: &'a Metrics,
    pub registry: &'a Registry,
    pub relays: &'a Relays,
    pub history: &'a History,
    pub health: &'a UpstreamHealth,
    pub open_files: &'a OpenFiles,
}

/// One reading, served as JSON by `GET /status`.
#[derive(Debug, Serialize)]
pub struct Status {
    /// Seconds since the admin listener started.
    pub uptime_secs: f64,
    pub proxy_id: String,
    pub upstream: UpstreamStatus,
    /// Totals since start; the page turns them into rates.
    pub counters: Counters,
    pub memory: Vec<Gauge>,
    /// Descriptors open against the limit.
    pub open_files: OpenFilesStatus,
    /// How many resources are tracked (polled variants and relayed sessions).
    pub resources_total: usize,
    /// The first [`MAX_LISTED`] of them, the most subscribed first.
    pub resources: Vec<ResourceStatus>,
}

/// The upstream's health, and its response times.
#[derive(Debug, Serialize)]
pub struct UpstreamStatus {
    pub url: String,
    /// The latest outcome of a request or probe was a success (or none yet).
    pub healthy: bool,
    pub last_ok_secs_ago: Option<f64>,
    pub last_failure: Option<String>,
    pub last_failure_secs_ago: Option<f64>,
    /// Responses timed (request sent to response headers) and their sum.
    pub responses: u64,
    pub response_seconds_sum: f64,
    /// Upper bounds of the buckets holding the median and the 99th percentile.
    pub response_p50_le: Option<f64>,
    pub response_p99_le: Option<f64>,
}

/// Counters since start.
#[derive(Debug, Serialize)]
pub struct Counters {
    pub requests: u64,
    pub subscriptions: i64,
    pub subscriptions_total: u64,
    pub updates_published: u64,
    /// Updates delivered to subscribers.
    pub updates_sent: u64,
    pub bytes_sent: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_revalidated: u64,
    pub upstream_errors: u64,
    /// Requests the watchers sent the origin: its rate is what change
    /// detection costs the origin.
    pub origin_polls: u64,
}

/// Descriptors open, counted at this reading, against the limit.
#[derive(Debug, Serialize)]
pub struct OpenFilesStatus {
    pub open: u64,
    /// The soft RLIMIT_NOFILE the process runs with (`--max-open-files`).
    pub limit: u64,
    /// Within this many of the limit, new subscriptions get 503.
    pub reserve: u64,
    /// Client connections and the last count of the others: what a new
    /// subscription is admitted on.
    pub estimate: u64,
}

/// One quantity held in memory, and its cap (`None`: not capped).
#[derive(Debug, Serialize)]
pub struct Gauge {
    pub name: &'static str,
    /// The flag that sets the cap.
    pub flag: &'static str,
    pub used: u64,
    pub cap: Option<u64>,
    /// `bytes` or `count`.
    pub unit: &'static str,
}

/// One tracked resource.
#[derive(Debug, Serialize)]
pub struct ResourceStatus {
    /// The path, and the query's names with their values hidden.
    pub path: String,
    /// Which variant of the URL it is, in words: the host, each `Vary`'d
    /// header with its value (a short digest in place of a credential's
    /// or a cookie's, or of a long value), and `credentials` when keyed by
    /// one. Empty for a relayed session.
    pub variant: String,
    /// `poll` (a plain origin, polled and diffed), `braid` (an upstream
    /// subscription relayed) or `unknown` (no answer has told yet).
    pub feed: &'static str,
    /// Keyed by a credential or not shareable.
    pub private: bool,
    pub version: Option<String>,
    pub subscribers: usize,
    /// Seconds since its current version was published, where known.
    pub last_change_secs_ago: Option<f64>,
    /// Seconds between its watcher's polls now (`None`: not polled).
    pub poll_interval_secs: Option<f64>,
    /// How its feed is doing, in words.
    pub health: String,
    pub healthy: bool,
}

impl Status {
    /// Reads the status now; `started` is when the admin listener started.
    pub fn read(from: Sources<'_>, started: Instant) -> Status {
        use std::sync::atomic::Ordering::Relaxed;
        let (config, metrics) = (from.config, from.metrics);
        let health = from.health.snapshot();
        let (responses, response_seconds_sum) = metrics.upstream_response_seconds.totals();
        let upstream = UpstreamStatus {
            url: config
                .upstream
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            healthy: from.health.down().is_none(),
            last_ok_secs_ago: health.last_ok.map(|at| secs(at.elapsed())),
            last_failure: health.last_failure.as_ref().map(|(_, r)| r.clone()),
            last_failure_secs_ago: health.last_failure.map(|(at, _)| secs(at.elapsed())),
            responses,
            response_seconds_sum,
            response_p50_le: metrics.upstream_response_seconds.quantile_bound(0.5),
            response_p99_le: metrics.upstream_response_seconds.quantile_bound(0.99),
        };
        let counters = Counters {
            requests: metrics.requests_total.load(Relaxed),
            subscriptions: metrics.subscriptions.load(Relaxed),
            subscriptions_total: metrics.subscriptions_total.load(Relaxed),
            updates_published: metrics.updates_published_total.load(Relaxed),
            updates_sent: metrics.updates_sent_total.load(Relaxed),
            bytes_sent: metrics.bytes_sent_total.load(Relaxed),
            cache_hits: metrics.cache_hits_total.load(Relaxed),
            cache_misses: metrics.cache_misses_total.load(Relaxed),
            cache_revalidated: metrics.cache_revalidated_total.load(Relaxed),
            upstream_errors: metrics.upstream_errors_total.load(Relaxed),
            origin_polls: metrics.polls_total.load(Relaxed),
        };
        let count = |n: i64| n.max(0) as u64;
        let open_files = OpenFilesStatus {
            open: from.open_files.count(),
            limit: from.open_files.limit(),
            reserve: from.open_files.reserve(),
            estimate: from.open_files.estimate(),
        };
        let memory = vec![
            Gauge {
                name: "tracked states",
                flag: "--state-bytes",
                used: from.registry.state_bytes() as u64,
                cap: Some(config.state_bytes as u64),
                unit: "bytes",
            },
            Gauge {
                name: "history of polled resources",
                flag: "--history-bytes",
                used: from.history.weighted_size(),
                cap: Some(config.history_bytes),
                unit: "bytes",
            },
            Gauge {
                name: "windows of relayed subscriptions",
                flag: "--history-bytes",
                used: from.relays.window_bytes() as u64,
                cap: Some(config.history_bytes),
                unit: "bytes",
            },
            Gauge {
                name: "queued to subscribers",
                flag: "--notsent-lowat",
                used: count(metrics.subscriber_pending_bytes.load(Relaxed)),
                cap: None,
                unit: "bytes",
            },
            Gauge {
                name: "subscriptions",
                flag: "--max-subscriptions",
                used: count(metrics.subscriptions.load(Relaxed)),
                cap: Some(config.max_subscriptions as u64),
                unit: "count",
            },
            Gauge {
                name: "private resources",
                flag: "--max-private-resources",
                used: from.registry.private_count() as u64,
                cap: Some(config.max_private_resources as u64),
                unit: "count",
            },
            Gauge {
                name: "open files",
                flag: "--max-open-files",
                used: open_files.open,
                cap: Some(open_files.limit),
                unit: "count",
            },
        ];
        let (mut resources, tracked) = polled(&from, config);
        let relayed = relayed(from.relays);
        let resources_total = tracked + relayed.len();
        resources.extend(relayed);
        resources.sort_by(|a, b| {
            b.subscribers
                .cmp(&a.subscribers)
                .then_with(|| a.path.cmp(&b.path))
        });
        resources.truncate(MAX_LISTED);
        Status {
            uptime_secs: secs(started.elapsed()),
            proxy_id: config.proxy_id.clone(),
            upstream,
            counters,
            memory,
            open_files,
            resources_total,
            resources,
        }
    }
}

/// A path and query with the query's values and the path's parameters
/// hidden: they may carry a client's secrets (`?token=...`,
/// `;jsessionid=...`), which the page must not show.
fn redact_query(path_and_query: &str) -> String {
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    let mut out = String::with_capacity(path_and_query.len());
    for (i, segment) in path.split('/').enumerate() {
        if i > 0 {
            out.push('/');
        }
        match segment.split_once(';') {
            Some((name, params)) => {
                out.push_str(name);
                for param in params.split(';') {
                    out.push(';');
                    match param.split_once('=') {
                        Some((key, _)) => {
                            out.push_str(key);
                            out.push_str("=…");
                        }
                        None => out.push('…'),
                    }
                }
            }
            None => out.push_str(segment),
        }
    }
    if let Some(query) = query {
        let names: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _)) => format!("{name}=…"),
                None => "…".to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&names.join("&"));
    }
    out
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// The registry's resources, polled (or not yet known) variants: the
/// [`MAX_LISTED`] most subscribed, described, and how many there are.
fn polled(from: &Sources<'_>, config: &Config) -> (Vec<ResourceStatus>, usize) {
    // As `/readyz`: the one rule, `Resource::unheard`.
    let limit = crate::state::unheard_limit(config.poll_ceiling());
    let mut all: Vec<_> = from
        .registry
        .all()
        .into_iter()
        .map(|r| (r.subscribers(), r))
        .collect();
    let tracked = all.len();
    // Only those that can be listed are described.
    if all.len() > MAX_LISTED {
        all.select_nth_unstable_by(MAX_LISTED, |(a, _), (b, _)| b.cmp(a));
        all.truncate(MAX_LISTED);
    }
    let listed = all
        .into_iter()
        .map(|(subscribers, r)| {
            let head = r.head();
            let answered_age = r.validation().answered_at.map(|at| at.elapsed());
            let (health, healthy) = match (&head.state, answered_age) {
                (State::Error { status, reason }, _) => {
                    (format!("error {status}: {reason}"), false)
                }
                _ if subscribers == 0 => ("not watched (no subscribers)".to_string(), true),
                (_, None) => ("no answer from the upstream yet".to_string(), false),
                (_, Some(age)) if r.unheard(limit) => (
                    format!("no answer from the upstream for {:.1} s", age.as_secs_f64()),
                    false,
                ),
                (State::Missing { status }, Some(age)) => (
                    format!(
                        "origin answers {status}, checked {:.1} s ago",
                        age.as_secs_f64()
                    ),
                    true,
                ),
                (State::Denied { status, .. }, Some(age)) => (
                    format!(
                        "origin refused the credentials ({status}) {:.1} s ago",
                        age.as_secs_f64()
                    ),
                    true,
                ),
                (_, Some(age)) => (format!("polled {:.1} s ago", age.as_secs_f64()), true),
            };
            ResourceStatus {
                path: redact_query(r.key()),
                variant: variant_label(&r.variant()),
                feed: match r.kind() {
                    Kind::Plain => "poll",
                    Kind::Braid => "braid",
                    Kind::Unknown => "unknown",
                },
                private: r.private,
                version: (!head.version.is_empty()).then(|| head.version.to_header_value()),
                subscribers,
                last_change_secs_ago: (head.seq > 0).then(|| secs(head.at.elapsed())),
                poll_interval_secs: r.poll_interval().map(secs),
                health,
                healthy,
            }
        })
        .collect();
    (listed, tracked)
}

/// The relayed upstream subscriptions (those that found a plain origin
/// show as the polled resource instead).
fn relayed(relays: &Relays) -> Vec<ResourceStatus> {
    relays
        .summaries()
        .into_iter()
        .filter(|s| !s.plain)
        .map(|s| {
            let (health, healthy) = match (s.opened, s.ended) {
                (_, true) => ("upstream stream ended", false),
                (None, false) => ("opening upstream subscription", true),
                (Some(false), false) => ("upstream did not answer 209", false),
                (Some(true), false) => ("upstream stream live", true),
            };
            ResourceStatus {
                path: redact_query(&s.path),
                variant: String::new(),
                feed: "braid",
                private: s.private,
                version: s.version.map(|v| v.to_header_value()),
                subscribers: s.subscribers,
                last_change_secs_ago: s.last_update.map(secs),
                poll_interval_secs: None,
                health: health.to_string(),
                healthy,
            }
        })
        .collect()
}

/// Headers whose values are never shown (a digest stands for them).
const HIDDEN: &[&str] = &["authorization", "cookie", "proxy-authorization"];

/// Longest `Vary`'d value shown as it is.
const SHOWN_VALUE: usize = 40;

/// A resource's secondary key ([`crate::floor::rules::secondary_key`]:
/// the host, then a `name:value` line per `Vary`'d header, then
/// `credentials:<digest>`) as `/status` shows it.
fn variant_label(secondary: &str) -> String {
    let mut lines = secondary.split('\n');
    let host = lines.next().unwrap_or_default();
    let mut out = if host.is_empty() {
        String::new()
    } else {
        format!("host {host}")
    };
    for line in lines {
        let (name, value) = line.split_once(':').unwrap_or((line, ""));
        let shown = if name == "credentials" {
            "credentials".to_string()
        } else if HIDDEN.contains(&name) || value.len() > SHOWN_VALUE {
            let digest = crate::state::repr_digest(value.as_bytes());
            let short: String = digest.chars().skip("sha-256=:".len()).take(8).collect();
            format!("{name} #{short}")
        } else if value.is_empty() {
            format!("{name} (none)")
        } else {
            format!("{name} {value}")
        };
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(&shown);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{redact_query, variant_label};

    #[test]
    fn variants_are_told_apart_without_showing_credentials() {
        assert_eq!(variant_label("docs.example"), "host docs.example");
        assert_eq!(
            variant_label("docs.example\nx-tenant:a\naccept-language:"),
            "host docs.example, x-tenant a, accept-language (none)"
        );
        let secret = variant_label("h\ncookie:session=s3cr3t\ncredentials:abcdef");
        assert!(
            !secret.contains("s3cr3t") && !secret.contains("abcdef"),
            "{secret}"
        );
        assert!(secret.starts_with("host h, cookie #") && secret.ends_with(", credentials"));
        let long = "v".repeat(100);
        assert!(!variant_label(&format!("h\nx-long:{long}")).contains(&long));
    }

    #[test]
    fn query_values_are_hidden() {
        assert_eq!(redact_query("/doc"), "/doc");
        assert_eq!(
            redact_query("/doc?token=secret&x=1&flag"),
            "/doc?token=…&x=…&…"
        );
        assert_eq!(
            redact_query("/a;jsessionid=S3CR3T/b;v=1;x?q=2"),
            "/a;jsessionid=…/b;v=…;…?q=…"
        );
    }
}
