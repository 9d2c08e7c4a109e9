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
    pub subscriptions_total: AtomicU64,
    pub subscriptions_rejected_total: AtomicU64,
    pub resources: AtomicI64,
    pub history_bytes: AtomicI64,
    pub subscriber_pending_bytes: AtomicI64,
    pub updates_published_total: AtomicU64,
    pub updates_sent_total: AtomicU64,
    pub collapsed_total: AtomicU64,
    pub snapshots_sent_total: AtomicU64,
    pub heartbeats_sent_total: AtomicU64,
    pub polls_not_modified_total: AtomicU64,
    pub diffs_total: AtomicU64,
    pub diffs_fallback_snapshot_total: AtomicU64,
    pub upstream_subscriptions: AtomicI64,
    pub upstream_updates_total: AtomicU64,
    pub upstream_reconnects_total: AtomicU64,
    pub upstream_resyncs_total: AtomicU64,
    pub state_bytes: AtomicI64,
    pub state_evictions_total: AtomicU64,
    pub cache_hits_total: AtomicU64,
    pub cache_misses_total: AtomicU64,
    pub cache_revalidated_total: AtomicU64,
    pub cache_not_stored_total: AtomicU64,
    pub patch_writes_total: AtomicU64,
    pub patch_conflicts_total: AtomicU64,
}

impl Metrics {
    pub(crate) fn pending_add(&self, n: usize) {
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
        let counters: [(&str, &AtomicU64, &str); 22] = [
            (
                "state_evictions_total",
                &self.state_evictions_total,
                "Idle resources evicted to keep tracked state under --state-bytes.",
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
                "Subscriptions refused by a cap.",
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
                "heartbeats_sent_total",
                &self.heartbeats_sent_total,
                "Heartbeat lines sent.",
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
            (
                "upstream_resyncs_total",
                &self.upstream_resyncs_total,
                "Braid upstream subscriptions restarted from a snapshot (unknown parents, unusable patches).",
            ),
        ];
        for (name, value, help) in counters {
            let _ = writeln!(out, "# HELP braid_proxy_{name} {help}\n# TYPE braid_proxy_{name} counter\nbraid_proxy_{name} {}", value.load(Relaxed));
        }
        let _ = writeln!(out, "# HELP braid_proxy_diffs_fallback_snapshot_total Diffs replaced by a snapshot (too large or too slow).\n# TYPE braid_proxy_diffs_fallback_snapshot_total counter\nbraid_proxy_diffs_fallback_snapshot_total {}", self.diffs_fallback_snapshot_total.load(Relaxed));
        let gauges: [(&str, &AtomicI64, &str); 6] = [
            (
                "state_bytes",
                &self.state_bytes,
                "Bytes of all tracked states (bodies and keys), capped by --state-bytes.",
            ),
            ("subscriptions", &self.subscriptions, "Open subscriptions."),
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
        out
    }
}
