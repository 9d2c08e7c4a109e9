//! A session's window as subscribers follow it ([`SessionWindow`], the
//! feed's [`Window`]): the next entry as received, or one collapsed update
//! for a laggard.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;

use crate::deliver::window::{Frozen, Step, Window};
use crate::floor::sync::lock;
use crate::metrics::Metrics;

use super::*;

/// Holds a subscriber's place in its session; leaving wakes the reader.
pub(super) struct Subscriber {
    pub(super) session: Arc<Session>,
    pub(super) metrics: Arc<Metrics>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.metrics.subscriptions.fetch_sub(1, Relaxed);
        self.session.subscribers.fetch_sub(1, Relaxed);
        self.session.left.notify_one();
    }
}

/// A session's window: positions are entry numbers; the head is the end
/// its reader last announced (entries framed after it are not visible yet).
pub(super) struct SessionWindow {
    pub(super) session: std::sync::Weak<Session>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) name: String,
}

impl Window for SessionWindow {
    fn name(&self) -> &str {
        &self.name
    }

    fn head(&self) -> Option<u64> {
        let session = self.session.upgrade()?;
        let tick = session.tick.borrow();
        (!tick.ended).then_some(tick.end)
    }

    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        let session = self.session.upgrade()?;
        let (end, prev, ended) = {
            let tick = session.tick.borrow();
            (tick.end, tick.prev, tick.ended)
        };
        Some(Box::new(SessionAt {
            session,
            end,
            prev,
            ended,
            metrics: self.metrics.clone(),
        }))
    }

    fn step_now(&self, at: u64) -> Option<(Step, bool)> {
        let session = self.session.upgrade()?;
        let (end, prev, ended) = {
            let tick = session.tick.borrow();
            (tick.end, tick.prev, tick.ended)
        };
        Some((session_step(&session, end, prev, &self.metrics, at), ended))
    }
}

/// What takes a subscriber at `at` toward `end` (the announced end; `prev`
/// the one before it): a laggard of a linear stream gets one collapsed
/// update to the end, any other the next entry as received.
pub(super) fn session_step(
    session: &Session,
    end: u64,
    prev: u64,
    metrics: &Metrics,
    at: u64,
) -> Step {
    if at >= end {
        return Step::Stay;
    }
    if at < prev {
        if let Some(bytes) = session.collapsed(at, end, metrics) {
            return Step::Write {
                bytes,
                to: end,
                updates: 1,
                snapshot: false,
            };
        }
    }
    let window = lock(&session.window);
    let entry = at
        .checked_sub(window.first)
        .and_then(|i| usize::try_from(i).ok())
        .and_then(|i| window.entries.get(i));
    match entry {
        Some(entry) => Step::Write {
            bytes: entry.raw.clone(),
            to: at + 1,
            updates: 1,
            snapshot: false,
        },
        None => Step::Lost,
    }
}

/// A session's window at one announced end.
pub(super) struct SessionAt {
    pub(super) session: Arc<Session>,
    pub(super) end: u64,
    /// The end before the latest announce: who is behind it lags.
    pub(super) prev: u64,
    pub(super) ended: bool,
    pub(super) metrics: Arc<Metrics>,
}

impl Frozen for SessionAt {
    fn head(&self) -> u64 {
        self.end
    }

    fn step(&self, at: u64) -> Step {
        session_step(&self.session, self.end, self.prev, &self.metrics, at)
    }

    /// The newest entry, as received: what a subscriber lacking only it is sent.
    fn usual(&self) -> Option<Bytes> {
        let window = lock(&self.session.window);
        let last = self.end.checked_sub(1)?.checked_sub(window.first)?;
        window
            .entries
            .get(usize::try_from(last).ok()?)
            .map(|e| e.raw.clone())
    }

    fn over(&self) -> bool {
        self.ended
    }
}
