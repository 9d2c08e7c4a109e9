//! A subscriber on its own task: one [`Cursor`] type for both feeds.
//!
//! A cursor is a position in a [`Window`] and nothing more: no queue. It
//! is the body of a 209 that hyper (or the fast path) pulls when the
//! connection has room; each pull asks the window what takes this position
//! to the head ([`Window::step_now`]), which for a slow reader is one collapsed
//! update or a snapshot, never the backlog. Between updates it waits on the
//! feed's change channel (any `watch`), the shared heartbeat tick and
//! shutdown. While it is parked, direct delivery advances its position in
//! the shared [`Link`]; the cursor adopts that position when it runs again.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;
use std::time::Instant;

use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::watch;

use super::direct::Link;
use crate::braid;
use crate::deliver::window::{Step, Window, NONE};
use crate::floor::body::{Body, Chunk};
use crate::metrics::Metrics;

/// A subscriber's position in a window, and what wakes it.
pub struct Cursor<T> {
    window: Arc<dyn Window>,
    /// The feed's change channel: a new value means a new head (or the end).
    changes: watch::Receiver<T>,
    /// Its position as direct delivery may advance it.
    link: Arc<Link>,
    /// The position the client has ([`NONE`]: nothing yet).
    at: u64,
    heartbeat: Option<watch::Receiver<u64>>,
    closing: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    /// What the feed holds for as long as the subscription lives (its
    /// counts and its resource).
    _held: Box<dyn Send + Sync>,
    /// For the close log.
    relayed: bool,
    opened: Instant,
    updates: u64,
    bytes: u64,
}

/// What a cursor is made of; see [`Cursor`].
pub struct Parts<T> {
    pub window: Arc<dyn Window>,
    pub changes: watch::Receiver<T>,
    pub link: Arc<Link>,
    pub at: u64,
    pub heartbeat: Option<watch::Receiver<u64>>,
    pub closing: watch::Receiver<bool>,
    pub metrics: Arc<Metrics>,
    pub held: Box<dyn Send + Sync>,
    pub relayed: bool,
}

impl<T: Send + Sync + 'static> Cursor<T> {
    /// Opens a subscription (logged) whose body this cursor is.
    pub fn body(parts: Parts<T>) -> Body {
        tracing::info!(
            target: "subscription",
            resource = parts.window.name(),
            relayed = parts.relayed,
            "subscription open"
        );
        parts.link.at.store(parts.at, Release);
        let cursor = Cursor {
            window: parts.window,
            changes: parts.changes,
            link: parts.link,
            at: parts.at,
            heartbeat: parts.heartbeat,
            closing: parts.closing,
            metrics: parts.metrics,
            _held: parts.held,
            relayed: parts.relayed,
            opened: Instant::now(),
            updates: 0,
            bytes: 0,
        };
        let mut cursor = cursor;
        // The 209's head is the first write: the first heartbeat counts from it.
        cursor.wrote();
        let stream = futures_util::stream::unfold(cursor, Cursor::next);
        StreamBody::new(stream).boxed_unsync()
    }

    /// The next frame for this subscriber, waiting until there is one.
    async fn next(mut self) -> Option<(Result<Frame<Chunk>, crate::floor::body::BoxError>, Self)> {
        loop {
            if *self.closing.borrow() {
                return None;
            }
            let advanced = self.link.at.load(Acquire);
            if advanced != NONE && (self.at == NONE || advanced > self.at) {
                // Direct delivery wrote meanwhile. When is not known here,
                // so the heartbeat stays due where it was: at worst one
                // comes soon after an update, never later than the interval.
                self.at = advanced;
            }
            let (step, over) = self.window.step_now(self.at)?;
            match step {
                Step::Write {
                    bytes,
                    to,
                    updates,
                    snapshot,
                } => {
                    self.at = to;
                    self.link.at.store(self.at, Release);
                    self.wrote();
                    self.updates += updates;
                    self.bytes += bytes.len() as u64;
                    self.metrics.updates_sent_total.fetch_add(updates, Relaxed);
                    if snapshot {
                        Metrics::inc(&self.metrics.snapshots_sent_total);
                    }
                    let chunk = Chunk::counted(bytes, &self.metrics);
                    return Some((Ok(Frame::data(chunk)), self));
                }
                // Fell out of the window: end; the client resumes with Parents.
                Step::Lost => return None,
                Step::Stay if over => return None,
                Step::Stay => {}
            }
            let heartbeat = async {
                match self.heartbeat.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = self.changes.changed() => if changed.is_err() { return None },
                ticked = heartbeat => {
                    if !ticked {
                        self.heartbeat = None;
                    } else if self.beat_is_due() {
                        self.wrote();
                        Metrics::inc(&self.metrics.heartbeats_sent_total);
                        let beat = braid::encode_heartbeat();
                        self.bytes += beat.len() as u64;
                        let chunk = Chunk::counted(beat, &self.metrics);
                        return Some((Ok(Frame::data(chunk)), self));
                    }
                },
                _ = self.closing.changed() => return None,
            }
        }
    }
}

impl<T> Cursor<T> {
    /// Something was written to the client: its next heartbeat is due
    /// [`TICKS_PER_BEAT`] ticks from now.
    fn wrote(&mut self) {
        if let Some(rx) = &self.heartbeat {
            let now = *rx.borrow();
            self.link.beat_due.store(now + TICKS_PER_BEAT, Release);
        }
    }

    /// Whether the tick seen now is the one a heartbeat is due at.
    fn beat_is_due(&mut self) -> bool {
        self.heartbeat
            .as_mut()
            .is_some_and(|rx| *rx.borrow_and_update() >= self.link.beat_due.load(Acquire))
    }
}

/// Heartbeat ticks per interval ([`crate::serve::subscribe::Heartbeats`]):
/// a heartbeat is due at the second tick after the last write, so the
/// silence before it is between half the interval and the interval.
pub const TICKS_PER_BEAT: u64 = 2;

impl<T> Drop for Cursor<T> {
    /// Logs the close of a subscription, with its duration, updates and bytes.
    fn drop(&mut self) {
        tracing::info!(
            target: "subscription",
            resource = self.window.name(),
            relayed = self.relayed,
            duration_ms = self.opened.elapsed().as_millis() as u64,
            updates = self.updates + self.link.direct_updates.load(Relaxed),
            bytes = self.bytes + self.link.direct_bytes.load(Relaxed),
            "subscription closed"
        );
    }
}
