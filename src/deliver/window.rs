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
//! a position ([`super::cursor::Cursor`] on its own task,
//! [`super::direct`] when parked), and both read the same window
//! object, one per resource (or relayed session) shared by its subscribers.
//!
//! [`Window::freeze`] fixes a view at the current head ([`Frozen`]), so
//! that one sweep over parked subscribers reads a consistent head even
//! while the feed publishes the next one; [`Window::step_now`] is one
//! cursor's step against the head of the moment, computed by the same
//! function as the view's step, without building a view.
//!
//! Each feed implements it: the polled feed's window is the resource's
//! head and its steps in the shared, byte-bounded history (in the state
//! layer), the Braid feed's is the relayed session's window of updates as
//! received (in the feed layer). Both stand on this module; it knows
//! neither.

use bytes::Bytes;

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
