//! Idle client connections: which have no request open, since when, and
//! the means to end them.
//!
//! Each client connection has its [`Streams`]: how many of its requests
//! are open (an HTTP/1.1 connection has one at most, an HTTP/2 one any
//! number), each held by a [`StreamGuard`] until its response body is
//! dropped, and since when none has been. A connection with none open is
//! idle: an HTTP/1.1 one waiting for its next request, an HTTP/2 one that
//! only answers PINGs, one that has not sent its first request yet. Two
//! things end idle connections:
//!
//! - **Time.** An HTTP/2 connection idle for `--h2-idle-timeout` (75 s,
//!   nginx's `keepalive_timeout`) is shut down gracefully (GOAWAY); an
//!   HTTP/1.1 one waits for its next request no longer than hyper's
//!   header-read timeout.
//! - **Descriptors.** Every client connection is one descriptor. When a
//!   new one is accepted within the descriptor reserve (the last
//!   sixteenth of the limit, where new subscriptions get 503), the idlest
//!   idle connections are closed, as many as it takes to leave the
//!   reserve and at most [`MAX_RECLAIMED`] at a time, as nginx closes
//!   idle keep-alive connections when it runs short of connections
//!   (`ngx_drain_connections`). So connections that do nothing cannot keep
//!   the admin listener, upstream connections and plain GETs from a
//!   descriptor, and a client whose idle connection was closed reconnects
//!   (HTTP/1.1 clients retry an idempotent request on a closed idle
//!   connection; an HTTP/2 one gets GOAWAY first). Connections with a
//!   request open (subscriptions among them) are never closed this way.
//!
//! [`Connections`] lists every client connection for that: a slot per
//! connection, taken at accept and given back when it ends, so that the
//! books cost one lock at each end of a connection and nothing per
//! request; the idlest are found by a scan, only when descriptors run low.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::floor::body::{Body, Chunk};

/// Most idle connections closed for one accepted connection: enough to
/// make room at once, few enough that a burst of accepts does not close
/// every idle connection there is (nginx drains 32 at a time).
pub const MAX_RECLAIMED: usize = 32;

/// How long a new connection that has not finished a request yet is left
/// alone: time for its first request to arrive, so that new connections
/// never close each other. One that served a request and waits for the
/// next (keep-alive) may be closed at once.
pub const FRESH_GRACE: Duration = Duration::from_secs(1);

/// The time idleness is measured from: milliseconds since the first use.
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    Instant::now().saturating_duration_since(epoch).as_millis() as u64
}

/// The requests of one client connection: how many are open, whether any
/// came, since when none is open, and whether it has been asked to end.
pub struct Streams {
    open: AtomicUsize,
    served: AtomicBool,
    /// When the last open request ended (or the connection was accepted),
    /// in [`now_ms`] milliseconds.
    idle_since: AtomicU64,
    /// Set when the connection is chosen to be closed for descriptors.
    reclaimed: AtomicBool,
    wake: Notify,
}

impl Default for Streams {
    fn default() -> Streams {
        Streams {
            open: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            idle_since: AtomicU64::new(now_ms()),
            reclaimed: AtomicBool::new(false),
            wake: Notify::new(),
        }
    }
}

impl Streams {
    /// One more request, until the guard is dropped.
    pub fn open(self: &Arc<Self>) -> StreamGuard {
        self.open.fetch_add(1, Relaxed);
        self.served.store(true, Relaxed);
        StreamGuard(self.clone())
    }

    /// Whether the connection has had a request.
    pub fn served(&self) -> bool {
        self.served.load(Relaxed)
    }

    /// Whether more than one request is open (src/listen/coalesce.rs).
    pub fn many(&self) -> bool {
        self.open.load(Relaxed) > 1
    }

    /// How long the connection has had no request open; `None` while one is.
    pub fn idle_for(&self) -> Option<Duration> {
        if self.open.load(Relaxed) > 0 {
            return None;
        }
        let since = self.idle_since.load(Relaxed);
        Some(Duration::from_millis(now_ms().saturating_sub(since)))
    }

    /// How long the connection has been idle, if it may be closed to give
    /// its descriptor back: no request open, and either it served one or
    /// it has been open longer than [`FRESH_GRACE`].
    fn reclaimable(&self) -> Option<Duration> {
        let idle = self.idle_for()?;
        (self.served() || idle >= FRESH_GRACE).then_some(idle)
    }

    /// Resolves once the connection has had no request open for `timeout`.
    pub async fn idle_timeout(&self, timeout: Duration) {
        loop {
            match self.idle_for() {
                Some(idle) if idle >= timeout => return,
                Some(idle) => tokio::time::sleep(timeout - idle).await,
                // Busy: look again a timeout later (the earliest it can end).
                None => tokio::time::sleep(timeout).await,
            }
        }
    }

    /// Resolves once the connection was chosen to be closed to give its
    /// descriptor back ([`Connections::reclaim`]).
    pub async fn reclaimed(&self) {
        loop {
            let woken = self.wake.notified();
            if self.reclaimed.load(Relaxed) {
                return;
            }
            woken.await;
        }
    }
}

/// A request counted in [`Streams`] while this lives.
pub struct StreamGuard(Arc<Streams>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Relaxed) == 1 {
            self.0.idle_since.store(now_ms(), Relaxed);
        }
    }
}

/// `body`, holding `guard` until it is dropped.
pub fn counted(body: Body, guard: StreamGuard) -> Body {
    Body::new(Counted {
        inner: body,
        _guard: guard,
    })
}

struct Counted {
    inner: Body,
    _guard: StreamGuard,
}

impl http_body::Body for Counted {
    type Data = Chunk;
    type Error = crate::floor::body::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Chunk>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Every client connection of a listener, so that the idlest can be closed
/// when descriptors run low. Cheap to share (`Arc`).
#[derive(Default)]
pub struct Connections {
    /// The lock is taken when a connection begins and ends, and by a
    /// reclaim (a scan, only within the descriptor reserve); never per
    /// request, never across an await.
    listed: Mutex<Listed>,
    /// Connections chosen to close that have not ended yet: they still
    /// hold their descriptors, and count as room already made.
    closing: AtomicUsize,
    /// When a scan last found nothing to close ([`now_ms`], 0 for never):
    /// none is made again for [`EMPTY_SCAN_PAUSE`], so that accepts among
    /// connections that are all busy do not each scan them.
    found_none: AtomicU64,
}

/// How long after a scan that found no idle connection the next is skipped.
const EMPTY_SCAN_PAUSE: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Listed {
    next: u64,
    by_id: HashMap<u64, Weak<Streams>>,
}

/// A connection's entry in [`Connections`], removed on drop.
pub struct Listing {
    connections: Arc<Connections>,
    id: u64,
    streams: Arc<Streams>,
}

impl Listing {
    /// The connection's requests.
    pub fn streams(&self) -> &Arc<Streams> {
        &self.streams
    }
}

impl Drop for Listing {
    fn drop(&mut self) {
        let mut listed = lock(&self.connections.listed);
        listed.by_id.remove(&self.id);
        drop(listed);
        if self.streams.reclaimed.load(Relaxed) {
            self.connections.closing.fetch_sub(1, Relaxed);
        }
    }
}

fn lock(m: &Mutex<Listed>) -> std::sync::MutexGuard<'_, Listed> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Connections {
    /// Lists a new connection (idle from now) until the listing is dropped.
    pub fn list(self: &Arc<Self>) -> Listing {
        let streams = Arc::new(Streams::default());
        let mut listed = lock(&self.listed);
        let id = listed.next;
        listed.next += 1;
        listed.by_id.insert(id, Arc::downgrade(&streams));
        drop(listed);
        Listing {
            connections: self.clone(),
            id,
            streams,
        }
    }

    /// Connections listed now.
    pub fn len(&self) -> usize {
        lock(&self.listed).by_id.len()
    }

    /// Whether none is listed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections chosen to close that have not ended yet.
    pub fn closing(&self) -> usize {
        self.closing.load(Relaxed)
    }

    /// Makes room for `wanted` descriptors by closing idle connections,
    /// the longest idle first (but new ones within [`FRESH_GRACE`] of
    /// their start): as many as `wanted` less those already closing, at
    /// most [`MAX_RECLAIMED`]. Returns how many were chosen now. Each ends in its own task (a graceful shutdown: GOAWAY for
    /// HTTP/2, a close for an HTTP/1.1 connection between requests).
    pub fn reclaim(&self, wanted: usize) -> usize {
        self.reclaim_with(wanted, true)
    }

    /// [`Connections::reclaim`] that scans even within [`EMPTY_SCAN_PAUSE`]
    /// of a scan that found none: for a new connection that is refused
    /// unless some idle one closes (a burst of busy ones may have just
    /// gone idle).
    pub fn reclaim_now(&self, wanted: usize) -> usize {
        self.reclaim_with(wanted, false)
    }

    fn reclaim_with(&self, wanted: usize, pause: bool) -> usize {
        let needed = wanted
            .saturating_sub(self.closing.load(Relaxed))
            .min(MAX_RECLAIMED);
        if needed == 0 {
            return 0;
        }
        let found_none = self.found_none.load(Relaxed);
        if pause
            && found_none != 0
            && now_ms().saturating_sub(found_none) < EMPTY_SCAN_PAUSE.as_millis() as u64
        {
            return 0;
        }
        let listed = lock(&self.listed);
        let mut idle: Vec<(Duration, Arc<Streams>)> = listed
            .by_id
            .values()
            .filter_map(Weak::upgrade)
            .filter(|s| !s.reclaimed.load(Relaxed))
            .filter_map(|s| s.reclaimable().map(|idle| (idle, s)))
            .collect();
        drop(listed);
        if idle.is_empty() {
            self.found_none.store(now_ms().max(1), Relaxed);
            return 0;
        }
        let chosen = needed.min(idle.len());
        if chosen < idle.len() {
            idle.select_nth_unstable_by(chosen, |a, b| b.0.cmp(&a.0));
        }
        for (_, streams) in idle.into_iter().take(chosen) {
            // Marked under the count first: its listing's drop gives it back.
            self.closing.fetch_add(1, Relaxed);
            streams.reclaimed.store(true, Relaxed);
            streams.wake.notify_waiters();
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_idlest_idle_connections_are_reclaimed_and_busy_ones_never() {
        let connections = Arc::new(Connections::default());
        // Served a request each, and wait for the next.
        let served = || {
            let listing = connections.list();
            drop(listing.streams().open());
            listing
        };
        let oldest = served();
        tokio::time::sleep(Duration::from_millis(30)).await;
        let busy = connections.list();
        let _request = busy.streams().open();
        let newer = served();
        let newest = served();
        // New, and no request yet: left alone.
        let fresh = connections.list();
        assert_eq!(connections.len(), 5);
        assert_eq!(connections.reclaim(2), 2);
        assert!(oldest.streams().reclaimed.load(Relaxed));
        assert!(!busy.streams().reclaimed.load(Relaxed));
        // The two chosen still hold their descriptors: no more are closed
        // for the same room until they end.
        assert_eq!(connections.reclaim(2), 0);
        let chosen = [&newer, &newest]
            .iter()
            .filter(|l| l.streams().reclaimed.load(Relaxed))
            .count();
        assert_eq!(chosen, 1);
        tokio::time::timeout(Duration::from_secs(1), oldest.streams().reclaimed())
            .await
            .expect("told");
        drop(oldest);
        // One more wanted: the last idle one; the busy one never.
        assert_eq!(connections.reclaim(2), 1);
        assert_eq!(connections.reclaim(10), 0);
        assert!(!busy.streams().reclaimed.load(Relaxed));
        assert!(!fresh.streams().reclaimed.load(Relaxed));
        assert_eq!(connections.closing(), 2);
    }

    #[tokio::test]
    async fn a_connection_about_to_be_refused_scans_even_right_after_an_empty_scan() {
        let connections = Arc::new(Connections::default());
        let busy = connections.list();
        let request = busy.streams().open();
        // All busy: the scan finds none, and the next ones pause.
        assert_eq!(connections.reclaim(1), 0);
        // The request ends: the connection is idle (it served one).
        drop(request);
        assert_eq!(connections.reclaim(1), 0, "within the pause");
        // A new connection that would be refused does not wait for it.
        assert_eq!(connections.reclaim_now(1), 1);
        assert!(busy.streams().reclaimed.load(Relaxed));
    }

    #[tokio::test]
    async fn a_connection_is_idle_from_its_last_requests_end() {
        let streams = Arc::new(Streams::default());
        let request = streams.open();
        assert_eq!(streams.idle_for(), None);
        let timeout = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(timeout * 2, streams.idle_timeout(timeout))
                .await
                .is_err(),
            "busy: not idle"
        );
        drop(request);
        let started = Instant::now();
        streams.idle_timeout(timeout).await;
        assert!(started.elapsed() >= timeout - Duration::from_millis(2));
    }
}
