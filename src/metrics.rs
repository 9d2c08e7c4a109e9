//! Counters and gauges, exposed in Prometheus text format on the admin listener.

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

/// Process-wide (per proxy instance) counters. Cheap to update from any task.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests_total: AtomicU64,
    pub upstream_requests_total: AtomicU64,
    pub upstream_errors_total: AtomicU64,
    pub subscriptions: AtomicI64,
    /// Subscriptions parked for direct delivery (src/deliver/direct.rs).
    pub subscriptions_parked: AtomicI64,
    pub subscriptions_total: AtomicU64,
    pub subscriptions_rejected_total: AtomicU64,
    pub resources: AtomicI64,
    pub resources_private: AtomicI64,
    pub history_bytes: AtomicI64,
    pub subscriber_pending_bytes: AtomicI64,
    pub updates_published_total: AtomicU64,
    pub updates_sent_total: AtomicU64,
    pub collapsed_total: AtomicU64,
    pub snapshots_sent_total: AtomicU64,
    /// Direct-delivery sweeps that took a head published while they ran.
    pub sweep_head_changes_total: AtomicU64,
    pub heartbeats_sent_total: AtomicU64,
    /// Requests the watchers sent to the origin (polls and refreshes).
    pub polls_total: AtomicU64,
    pub polls_not_modified_total: AtomicU64,
    pub diffs_total: AtomicU64,
    pub diffs_fallback_snapshot_total: AtomicU64,
    pub upstream_subscriptions: AtomicI64,
    pub upstream_updates_total: AtomicU64,
    pub upstream_reconnects_total: AtomicU64,
    pub state_bytes: AtomicI64,
    /// Descriptors open, counted at each scrape.
    pub open_fds: AtomicI64,
    /// The descriptor limit the process runs with.
    pub max_fds: AtomicI64,
    pub state_evictions_total: AtomicU64,
    pub state_refusals_total: AtomicU64,
    pub cache_hits_total: AtomicU64,
    pub cache_misses_total: AtomicU64,
    pub cache_revalidated_total: AtomicU64,
    pub cache_not_stored_total: AtomicU64,
    /// Stored answers (variants) dropped by the admin listener's purge.
    pub cache_purged_total: AtomicU64,
    pub patch_writes_total: AtomicU64,
    pub patch_conflicts_total: AtomicU64,
    /// Bytes of updates and heartbeats handed to subscriber connections.
    pub bytes_sent_total: AtomicU64,
    pub upstream_connect_errors_total: AtomicU64,
    pub upstream_timeouts_total: AtomicU64,
    pub upstream_broken_total: AtomicU64,
    /// Time from sending an upstream request to its response headers.
    pub upstream_response_seconds: Histogram,
    /// Time one sweep of direct delivery takes to write an update to every
    /// parked subscriber of a resource (src/deliver/direct.rs).
    pub sweep_seconds: Histogram,
}

/// A Prometheus histogram with fixed buckets, in seconds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    total: AtomicU64,
}

/// Buckets for upstream response times.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Buckets for the age of resources' last successful validation.
pub const AGE_BUCKETS: &[f64] = &[0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new(LATENCY_BUCKETS)
    }
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, seconds: f64) {
        if let Some(i) = self.bounds.iter().position(|b| seconds <= *b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_micros
            .fetch_add((seconds * 1e6).max(0.0) as u64, Relaxed);
        self.total.fetch_add(1, Relaxed);
    }

    /// How many observations, and their sum in seconds.
    pub fn totals(&self) -> (u64, f64) {
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        (self.total.load(Relaxed), sum)
    }

    /// The upper bound of the bucket that holds the `q` quantile (0 to 1)
    /// of the observations; `None` without any, or past the last bucket.
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        let total = self.total.load(Relaxed);
        if total == 0 {
            return None;
        }
        let rank = ((total as f64) * q.clamp(0.0, 1.0)).ceil().max(1.0) as u64;
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Relaxed);
            if cumulative >= rank {
                return Some(*bound);
            }
        }
        None
    }

    /// Writes the histogram in the text exposition format.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(
            out,
            "# HELP braid_proxy_{name} {help}\n# TYPE braid_proxy_{name} histogram"
        );
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Relaxed);
            let _ = writeln!(
                out,
                "braid_proxy_{name}_bucket{{le=\"{bound}\"}} {cumulative}"
            );
        }
        let total = self.total.load(Relaxed);
        let _ = writeln!(out, "braid_proxy_{name}_bucket{{le=\"+Inf\"}} {total}");
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(
            out,
            "braid_proxy_{name}_sum {sum}\nbraid_proxy_{name}_count {total}"
        );
    }
}

impl Metrics {
    pub(crate) fn pending_add(&self, n: usize) {
        self.bytes_sent_total.fetch_add(n as u64, Relaxed);
        self.subscriber_pending_bytes.fetch_add(n as i64, Relaxed);
    }

    pub(crate) fn pending_sub(&self, n: usize) {
        self.subscriber_pending_bytes.fetch_sub(n as i64, Relaxed);
    }

    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    /// Renders every metric in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(2048);
        let counters: [(&str, &AtomicU64, &str); 29] = [
            (
                "bytes_sent_total",
                &self.bytes_sent_total,
                "Bytes of updates and heartbeats handed to subscriber connections.",
            ),
            (
                "upstream_connect_errors_total",
                &self.upstream_connect_errors_total,
                "Upstream requests that could not connect.",
            ),
            (
                "upstream_timeouts_total",
                &self.upstream_timeouts_total,
                "Upstream requests without response headers within --response-timeout.",
            ),
            (
                "upstream_broken_total",
                &self.upstream_broken_total,
                "Upstream requests that failed after connecting (reset, protocol error).",
            ),
            (
                "state_evictions_total",
                &self.state_evictions_total,
                "Idle resources evicted to keep tracked state under --state-bytes.",
            ),
            (
                "state_refusals_total",
                &self.state_refusals_total,
                "New resources refused (503, or a GET answer not stored) because resources in use hold --state-bytes.",
            ),
            (
                "cache_hits_total",
                &self.cache_hits_total,
                "Plain GETs answered from stored state without the origin (Cache-Status: hit).",
            ),
            (
                "cache_misses_total",
                &self.cache_misses_total,
                "Plain GETs sent to the origin with nothing reusable stored (fwd=miss/uri-miss).",
            ),
            (
                "cache_revalidated_total",
                &self.cache_revalidated_total,
                "Plain GETs answered from stored state after the origin's 304 (fwd=stale, fwd-status=304).",
            ),
            (
                "cache_not_stored_total",
                &self.cache_not_stored_total,
                "Origin answers to plain GETs that could not be stored (private, no-store, Set-Cookie, ...).",
            ),
            (
                "cache_purged_total",
                &self.cache_purged_total,
                "Stored answers (variants) purged through the admin listener's POST /purge.",
            ),
            (
                "requests_total",
                &self.requests_total,
                "Client requests received.",
            ),
            (
                "patch_writes_total",
                &self.patch_writes_total,
                "Braid patch writes the proxy applied and wrote to a plain origin.",
            ),
            (
                "patch_conflicts_total",
                &self.patch_conflicts_total,
                "Braid patch writes answered 409 (stale Parents or origin 412).",
            ),
            (
                "upstream_requests_total",
                &self.upstream_requests_total,
                "Requests sent to the upstream.",
            ),
            (
                "upstream_errors_total",
                &self.upstream_errors_total,
                "Upstream requests that failed or timed out.",
            ),
            (
                "subscriptions_total",
                &self.subscriptions_total,
                "Subscriptions accepted.",
            ),
            (
                "subscriptions_rejected_total",
                &self.subscriptions_rejected_total,
                "Subscriptions refused by a cap: --max-subscriptions, --max-subscriptions-per-resource, or the reserve of open files.",
            ),
            (
                "updates_published_total",
                &self.updates_published_total,
                "New versions learned from the upstream.",
            ),
            (
                "updates_sent_total",
                &self.updates_sent_total,
                "Update frames handed to subscriber connections.",
            ),
            (
                "collapsed_total",
                &self.collapsed_total,
                "Catch-up updates that merged several updates for a lagging subscriber.",
            ),
            (
                "snapshots_sent_total",
                &self.snapshots_sent_total,
                "Snapshots handed to subscriber connections.",
            ),
            (
                "sweep_head_changes_total",
                &self.sweep_head_changes_total,
                "Direct-delivery sweeps that went on with a version published while they ran.",
            ),
            (
                "heartbeats_sent_total",
                &self.heartbeats_sent_total,
                "Heartbeat lines sent.",
            ),
            (
                "polls_total",
                &self.polls_total,
                "Requests the watchers sent a plain origin (polls, refreshes, revalidations for new subscribers); its rate is what change detection costs the origin.",
            ),
            (
                "polls_not_modified_total",
                &self.polls_not_modified_total,
                "Conditional polls answered 304.",
            ),
            ("diffs_total", &self.diffs_total, "Diffs computed."),
            (
                "upstream_updates_total",
                &self.upstream_updates_total,
                "Updates received on Braid upstream subscriptions.",
            ),
            (
                "upstream_reconnects_total",
                &self.upstream_reconnects_total,
                "Braid upstream subscriptions opened again after one ended or broke.",
            ),
        ];
        for (name, value, help) in counters {
            let _ = writeln!(out, "# HELP braid_proxy_{name} {help}\n# TYPE braid_proxy_{name} counter\nbraid_proxy_{name} {}", value.load(Relaxed));
        }
        let _ = writeln!(out, "# HELP braid_proxy_diffs_fallback_snapshot_total Diffs replaced by a snapshot (too large or too slow).\n# TYPE braid_proxy_diffs_fallback_snapshot_total counter\nbraid_proxy_diffs_fallback_snapshot_total {}", self.diffs_fallback_snapshot_total.load(Relaxed));
        let gauges: [(&str, &AtomicI64, &str); 10] = [
            (
                "resources_private",
                &self.resources_private,
                "Resources tracked for one credential, or not shareable (capped by --max-private-resources).",
            ),
            (
                "state_bytes",
                &self.state_bytes,
                "Bytes of all tracked states (bodies and keys), capped by --state-bytes.",
            ),
            (
                "open_fds",
                &self.open_fds,
                "File descriptors open (client connections, upstream connections, listeners), counted at this scrape.",
            ),
            (
                "max_fds",
                &self.max_fds,
                "File descriptors the process may hold (RLIMIT_NOFILE, set by --max-open-files); new subscriptions get 503 within the last sixteenth (at least 64).",
            ),
            ("subscriptions", &self.subscriptions, "Open subscriptions."),
            (
                "subscriptions_parked",
                &self.subscriptions_parked,
                "Subscriptions caught up and parked: each change is written to them by one pass per resource.",
            ),
            (
                "upstream_subscriptions",
                &self.upstream_subscriptions,
                "Open subscriptions to a Braid upstream (one per resource at most).",
            ),
            ("resources", &self.resources, "Resources tracked."),
            (
                "history_bytes",
                &self.history_bytes,
                "Bytes held in the history windows of all resources.",
            ),
            (
                "subscriber_pending_bytes",
                &self.subscriber_pending_bytes,
                "Bytes handed to subscriber connections and not yet written to their sockets.",
            ),
        ];
        for (name, value, help) in gauges {
            let _ = writeln!(out, "# HELP braid_proxy_{name} {help}\n# TYPE braid_proxy_{name} gauge\nbraid_proxy_{name} {}", value.load(Relaxed));
        }
        self.upstream_response_seconds.render(
            &mut out,
            "upstream_response_seconds",
            "Time from an upstream request to its response headers (polls, subscriptions, pass-through).",
        );
        self.sweep_seconds.render(
            &mut out,
            "sweep_seconds",
            "Time one direct-delivery sweep takes to write an update to every parked subscriber of a resource.",
        );
        out
    }
}
