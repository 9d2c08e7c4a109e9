//! One window model for both feeds: what a subscriber follows.
//!
//! A [`Window`] is a resource's updates as subscribers see them: positions
//! that only grow (the polled feed's seqs; the Braid feed's entry numbers),
//! a head (the position of a subscriber that has everything), and, for any
//! position behind the head, the bytes that take a subscriber there. Those
//! bytes are already encoded and shared: the head's own update, one
//! collapsed update (composed patches, or a snapshot with the right
//! `Parents`) for a laggard, or for a Braid stream that cannot be collapsed
//! the entries as received. Nothing per subscriber is held: a subscriber is
//! a position ([`crate::serve::cursor::Cursor`] on its own task,
//! [`crate::serve::direct`] when parked), and both read the same window
//! object, one per resource (or relayed session) shared by its subscribers.
//!
//! [`Window::freeze`] fixes a view at the current head ([`Frozen`]), so
//! that one sweep over parked subscribers reads a consistent head even
//! while the feed publishes the next one; [`Window::step_now`] is one
//! cursor's step against the head of the moment, computed by the same
//! function as the view's step, without building a view.
//!
//! The polled feed's window is [`Polled`] (the resource's head, and its
//! steps in the shared, byte-bounded history; over once the head is a
//! denial, [`super::State::Denied`]); the Braid feed's is the relayed
//! session's (`crate::feed::braid`).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use bytes::Bytes;

use super::resource::{Head, History, Resource};
use crate::metrics::Metrics;

/// No position: the subscriber has nothing yet and needs a snapshot.
pub const NONE: u64 = u64::MAX;

/// What takes a subscriber at some position to a view's head.
pub enum Step {
    /// Nothing to send: it is at the head.
    Stay,
    /// Send `bytes` (unframed), which carry `updates` updates; the
    /// subscriber is then at `to`: the head, or for a stream relayed as
    /// received, the next entry (each entry is then sent as it came, with
    /// no copy).
    Write {
        bytes: Bytes,
        to: u64,
        updates: u64,
        snapshot: bool,
    },
    /// Its position fell out of what the window keeps and the stream cannot
    /// be collapsed: its response ends, and the client resumes with
    /// `Parents` (a Braid stream with a `Merge-Type`).
    Lost,
}

/// A resource's updates as subscribers follow them (see the module docs).
pub trait Window: Send + Sync + 'static {
    /// The head position; `None` once the window is gone.
    fn head(&self) -> Option<u64>;
    /// A view fixed at the current head; `None` once the window is gone.
    fn freeze(&self) -> Option<Box<dyn Frozen>>;
    /// The URL it is of, for the subscription log.
    fn name(&self) -> &str;
    /// What takes a subscriber at `at` toward the current head, and whether
    /// the feed is over: one cursor's step, which a feed may answer without
    /// building a view (it runs per update per subscriber on its own task).
    fn step_now(&self, at: u64) -> Option<(Step, bool)> {
        let view = self.freeze()?;
        Some((view.step(at), view.over()))
    }
}

/// A window fixed at one head.
pub trait Frozen: Send + Sync {
    /// The position every step takes a subscriber to.
    fn head(&self) -> u64;
    /// What takes a subscriber at `at` ([`NONE`]: nothing) to the head,
    /// or toward it.
    fn step(&self, at: u64) -> Step;
    /// The step from the position just before the head, when it is the
    /// head's own update (what caught-up subscribers are sent): built once,
    /// read without a lock.
    fn usual(&self) -> Option<Bytes> {
        None
    }
    /// No more updates will come after this head (the feed ended).
    fn over(&self) -> bool {
        false
    }
    /// `chunk`, held by a laggard's write: counted against `--state-bytes`
    /// for as long as it lives where the feed counts such copies.
    fn hold(&self, chunk: Bytes) -> Bytes {
        chunk
    }
}

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
        None => {
            let built = !head.has_snapshot();
            let snapshot = head.snapshot();
            if built && resource.head().seq == head.seq {
                // A new copy held by the head: counted.
                resource.reweigh();
            }
            (snapshot, true)
        }
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
    let held = resource.held();
    held.fetch_add(bytes.len(), Relaxed);
    Bytes::from_owner(Held { bytes, held })
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
