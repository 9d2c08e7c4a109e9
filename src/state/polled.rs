//! The polled feed's window ([`Polled`]): a resource's seqs, its head's
//! update, and the steps the shared, byte-bounded history keeps; over
//! once the head is a denial ([`super::State::Denied`]). Subscribers
//! follow it through [`crate::deliver::window::Window`].

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use bytes::Bytes;

use super::resource::{Head, History, Resource};
use crate::deliver::window::{Frozen, Step, Window, NONE};
use crate::metrics::Metrics;

/// The polled feed's window: a resource's seqs, its head's update, and the
/// steps the shared history keeps.
pub struct Polled {
    pub resource: Weak<Resource>,
    pub history: Arc<History>,
    pub metrics: Arc<Metrics>,
    pub name: String,
}

impl Window for Polled {
    fn name(&self) -> &str {
        &self.name
    }

    fn head(&self) -> Option<u64> {
        Some(self.resource.upgrade()?.head().seq)
    }

    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        let resource = self.resource.upgrade()?;
        let head = resource.head();
        Some(Box::new(PolledAt {
            resource,
            head,
            history: self.history.clone(),
            metrics: self.metrics.clone(),
        }))
    }

    fn step_now(&self, at: u64) -> Option<(Step, bool)> {
        let resource = self.resource.upgrade()?;
        let head = resource.head();
        let step = polled_step(&resource, &head, &self.history, &self.metrics, at);
        Some((step, head.state.is_final()))
    }
}

impl Resource {
    /// Its window as subscribers follow it (built once, shared by all).
    pub fn window(
        self: &Arc<Self>,
        history: &Arc<History>,
        metrics: &Arc<Metrics>,
    ) -> Arc<dyn Window> {
        self.followed
            .get_or_init(|| {
                Arc::new(Polled {
                    resource: Arc::downgrade(self),
                    history: history.clone(),
                    metrics: metrics.clone(),
                    name: self.key().to_string(),
                })
            })
            .clone()
    }
}

/// [`Polled`] at one head.
struct PolledAt {
    resource: Arc<Resource>,
    head: Arc<Head>,
    history: Arc<History>,
    metrics: Arc<Metrics>,
}

impl Frozen for PolledAt {
    fn head(&self) -> u64 {
        self.head.seq
    }

    fn step(&self, at: u64) -> Step {
        polled_step(&self.resource, &self.head, &self.history, &self.metrics, at)
    }

    fn usual(&self) -> Option<Bytes> {
        self.head.update.clone()
    }

    fn hold(&self, chunk: Bytes) -> Bytes {
        counted(chunk, &self.resource)
    }

    /// A denial ends its subscribers' streams after they are sent it.
    fn over(&self) -> bool {
        self.head.state.is_final()
    }
}

/// What takes a subscriber at `at` ([`NONE`]: nothing) to `head`: its own
/// update, a collapsed one, or a snapshot.
fn polled_step(
    resource: &Resource,
    head: &Head,
    history: &History,
    metrics: &Metrics,
    at: u64,
) -> Step {
    if head.seq == 0 || at == head.seq {
        return Step::Stay;
    }
    let update = match at {
        NONE => None,
        at if at + 1 == head.seq && head.update.is_some() => head.update.clone(),
        at if at < head.seq => resource.catch_up(at, head, history, metrics),
        _ => None,
    };
    let (bytes, snapshot) = match update {
        Some(update) => (update, false),
        // Counted for as long as any copy of it lives (Head::snapshot).
        None => (head.snapshot(), true),
    };
    Step::Write {
        bytes,
        to: head.seq,
        updates: 1,
        snapshot,
    }
}

/// Chunks at least this large are counted against `--state-bytes` while
/// they are held (a snapshot's chunk for laggards is a copy of its body).
const COUNTED_CHUNK: usize = 64 * 1024;

/// `bytes`, counted in `resource`'s registry total for as long as any copy
/// of it lives.
fn counted(bytes: Bytes, resource: &Resource) -> Bytes {
    if bytes.len() < COUNTED_CHUNK {
        return bytes;
    }
    held_bytes(bytes, &resource.held())
}

/// `bytes`, counted in `total` from now until its last copy is dropped:
/// one count however many subscribers hold a copy.
pub(super) fn held_bytes(bytes: Bytes, total: &Arc<AtomicUsize>) -> Bytes {
    total.fetch_add(bytes.len(), Relaxed);
    Bytes::from_owner(Held {
        bytes,
        held: total.clone(),
    })
}

/// The owner of a counted chunk: uncounts it when the last copy goes.
struct Held {
    bytes: Bytes,
    held: Arc<AtomicUsize>,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes.len(), Relaxed);
    }
}
