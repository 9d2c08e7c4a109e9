//! Direct delivery: one pass per update writes it to every caught-up
//! HTTP/1.1 subscriber's socket, instead of waking one task per subscriber.
//!
//! A subscription answered on the listener's HTTP/1.1 fast path that has
//! sent everything up to its window's head *parks*: its connection task
//! stops polling the subscription body (so nothing wakes it on a change)
//! and registers its socket in the window's [`Parked`] set. The window is
//! either feed's ([`crate::deliver::window`]: a polled resource, whose
//! updates are the proxy's own, or a relayed upstream subscription, whose
//! updates are the upstream's bytes). When the window has more, its sweeper task takes
//! each parked subscriber in
//! turn and writes the update to its socket with one non-blocking
//! `sendmsg`, framed as an HTTP/1.1 chunk that is built once per update
//! and shared by all of them. A subscriber whose socket takes the whole
//! chunk stays parked, with its position (its [`Link`]) advanced. Any other
//! outcome hands the subscriber back to its own task, which finishes the
//! chunk the sweep began, if any, and continues on the ordinary path of
//! [`crate::serve::subscribe`]: a laggard gets one collapsed update when its
//! socket drains, exactly as before. There is still no queue: the sweep
//! holds one shared chunk, and a parked subscriber is a position and a
//! socket.
//!
//! Over TLS ([`Socket::Tls`]) the sweep hands each parked subscriber's
//! session the same shared chunk, which the session encrypts with its own
//! keys and writes as far as the socket takes it; encrypted bytes the
//! socket did not take hand the subscriber back, as a partial write does.
//!
//! A parked task still wakes for its client closing, the shared heartbeat
//! tick, and shutdown: it takes itself back (a compare-and-swap on its
//! state, so it and the sweep never write to the socket at once) and goes
//! on as an ordinary subscription.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{watch, Notify};

use crate::deliver::socket::{Sent, Socket};
use crate::deliver::window::{self, Frozen, Window, NONE};
use crate::floor::chunk::chunk;
use crate::floor::sync::lock;
use crate::metrics::Metrics;

/// A chunk, the updates it carries, and whether it is a snapshot.
type Joined = (Bytes, u64, bool);

/// What takes a subscriber at `at` to the head of `frozen`, as one chunk:
/// the steps joined (a relayed stream's entries as received), counted
/// where the feed counts held copies; `None` when it fell out of the
/// window (its task ends it).
fn joined(frozen: &dyn Frozen, mut at: u64) -> Option<Joined> {
    let head = frozen.head();
    let (mut parts, mut updates, mut snapshot) = (Vec::new(), 0, false);
    while at != head {
        match frozen.step(at) {
            window::Step::Write {
                bytes,
                to,
                updates: n,
                snapshot: s,
            } if to > at || at == NONE => {
                parts.push(bytes);
                updates += n;
                snapshot |= s;
                at = to;
            }
            _ => return None,
        }
    }
    let framed = match parts.as_slice() {
        [] => return None,
        [one] => chunk(one),
        many => chunk(&many.concat()),
    };
    Some((frozen.hold(framed), updates, snapshot))
}

/// What one sweep writes to a parked subscriber.
enum Due {
    /// Nothing to write: it stays parked.
    Stay,
    /// Write this HTTP/1.1 chunk, which carries `updates` updates.
    Write {
        chunk: Bytes,
        updates: u64,
        snapshot: bool,
    },
    /// Its task takes over (it fell out of what the window keeps).
    HandBack,
}

/// One sweep's view of its window, shared by the sweep's shards: each
/// position's chunk is framed once, whichever shard asks first, and the
/// usual one (the head's own update) is framed up front and read without
/// a lock.
struct Pass {
    frozen: Box<dyn Frozen>,
    usual: Option<Bytes>,
    framed: Mutex<HashMap<u64, Option<Joined>>>,
}

impl Pass {
    /// A pass over `window` at its head; `None` once it is gone or over.
    fn of(window: &dyn Window) -> Option<Pass> {
        let frozen = window.freeze().filter(|f| !f.over())?;
        Some(Pass {
            usual: frozen.usual().map(|u| chunk(&u)),
            frozen,
            framed: Mutex::default(),
        })
    }

    fn head(&self) -> u64 {
        self.frozen.head()
    }

    fn step(&self, at: u64) -> Due {
        if let Some(usual) = self.usual.as_ref().filter(|_| at + 1 == self.head()) {
            return Due::Write {
                chunk: usual.clone(),
                updates: 1,
                snapshot: false,
            };
        }
        let frozen = &self.frozen;
        let framed = lock(&self.framed)
            .entry(at)
            .or_insert_with(|| joined(&**frozen, at))
            .clone();
        match framed {
            Some((chunk, updates, snapshot)) => Due::Write {
                chunk,
                updates,
                snapshot,
            },
            None => Due::HandBack,
        }
    }
}

const ACTIVE: u8 = 0;
const PARKED: u8 = 1;
const WRITING: u8 = 2;
const RETURNED: u8 = 3;

/// Shared by a subscription's cursor and its connection task: where the
/// client is, and who may write to its socket.
///
/// In declaration order (`repr(C)`), so that what a sweep touches for each
/// subscriber (the first five fields) shares one cache line with the
/// `Arc`'s counts.
#[repr(C)]
pub struct Link {
    /// The seq the client has ([`NONE`] before its first update). The
    /// cursor adopts it when it runs again after direct deliveries.
    pub at: AtomicU64,
    state: AtomicU8,
    /// The sweep found the socket broken.
    broken: AtomicBool,
    /// Updates and bytes the sweep wrote, for the subscription's close log.
    pub direct_updates: AtomicU64,
    pub direct_bytes: AtomicU64,
    returned: Notify,
    /// What is left of a chunk the sweep began but the socket did not take.
    rest: Mutex<Option<Bytes>>,
    /// The heartbeat tick at which the client's next heartbeat is due
    /// (set by its cursor on each write; a parked subscription is taken
    /// back from the sweep only then).
    pub beat_due: AtomicU64,
}

impl Default for Link {
    fn default() -> Link {
        Link {
            at: AtomicU64::new(NONE),
            state: AtomicU8::new(ACTIVE),
            broken: AtomicBool::new(false),
            direct_updates: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            returned: Notify::new(),
            rest: Mutex::new(None),
            beat_due: AtomicU64::new(0),
        }
    }
}

/// What a 209 that can be delivered to directly carries (as a response
/// extension) for the fast path to park it.
#[derive(Clone)]
pub struct Handle {
    pub window: Arc<dyn Window>,
    pub parked: Arc<Parked>,
    pub link: Arc<Link>,
    pub metrics: Arc<Metrics>,
    /// The shared heartbeat tick of this subscription, if it has heartbeats.
    pub heartbeat: Option<watch::Receiver<u64>>,
    /// Set when the proxy shuts down.
    pub closing: watch::Receiver<bool>,
}

/// One parked subscriber: its socket and its position.
struct ParkedSocket {
    /// The ticket's id, so that a ticket removes its own entry only.
    id: u64,
    stream: Arc<Socket>,
    link: Arc<Link>,
}

/// The parked subscribers, inline in one vector so that a sweep reads them
/// in order. A removal leaves a hole (reused by a later park) instead of
/// moving an entry, so a sweep that goes on after a pause never skips one.
#[derive(Default)]
struct Shard {
    slots: Vec<Option<ParkedSocket>>,
    holes: Vec<usize>,
}

impl Shard {
    fn insert(&mut self, entry: ParkedSocket) -> usize {
        match self.holes.pop() {
            Some(i) => {
                self.slots[i] = Some(entry);
                i
            }
            None => {
                self.slots.push(Some(entry));
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, index: usize, id: u64) {
        let Some(slot) = self.slots.get_mut(index) else {
            return;
        };
        if slot.as_ref().is_some_and(|e| e.id == id) {
            *slot = None;
            self.holes.push(index);
            if self.holes.len() == self.slots.len() {
                self.slots.clear();
                self.holes.clear();
            }
        }
    }
}

/// Subscribers a sweep writes to between two yields to the other tasks of
/// its worker. The set is locked meanwhile (parks and unparks wait).
const SWEEP_BATCH: usize = 128;

/// Most shards one window's parked subscribers are split into.
const MAX_SHARDS: usize = 64;

/// The parked subscribers of one window, and its sweeper's wake-up.
///
/// They are split into as many shards as the runtime has workers (taken in
/// turn as they park), and each sweep writes the shards in parallel, one
/// task each, so that one busy resource is not swept on one core while the
/// others idle. With one worker there is one shard and no extra task.
pub struct Parked {
    shards: Box<[Mutex<Shard>]>,
    next_id: AtomicU64,
    /// Set once a sweeper task runs for this window.
    sweeping: AtomicBool,
    /// Notified when the window has more, and when it is over.
    published: Notify,
    closed: AtomicBool,
}

impl Default for Parked {
    fn default() -> Parked {
        let workers =
            tokio::runtime::Handle::try_current().map_or(1, |rt| rt.metrics().num_workers());
        Parked::with_shards(workers)
    }
}

impl Parked {
    fn with_shards(n: usize) -> Parked {
        Parked {
            shards: (0..n.clamp(1, MAX_SHARDS))
                .map(|_| Mutex::default())
                .collect(),
            next_id: AtomicU64::new(0),
            sweeping: AtomicBool::new(false),
            published: Notify::new(),
            closed: AtomicBool::new(false),
        }
    }

    fn shard_of(&self, id: u64) -> &Mutex<Shard> {
        &self.shards[(id % self.shards.len() as u64) as usize]
    }

    /// Wakes the sweeper: the window has a new head.
    pub fn published(&self) {
        self.published.notify_one();
    }

    /// Ends the sweeper, which hands every parked subscriber back: the
    /// window is over.
    pub fn close(&self) {
        self.closed.store(true, Release);
        self.published.notify_one();
    }
}

/// How a parked subscriber came back to its task.
pub enum Back {
    /// Continue on the ordinary path, after writing `rest` (a chunk the
    /// sweep began) if there is one, and over TLS what the sweep left
    /// encrypted in the session.
    Resume { rest: Option<Bytes> },
    /// The socket is broken: close.
    Broken,
}

/// A parked subscription, from its task's side.
pub struct Parking {
    id: u64,
    index: usize,
    handle: Handle,
}

impl Handle {
    /// Parks this subscription if it is caught up with its window's head;
    /// `None` when it is not (the task goes on polling its body).
    pub fn park(&self, stream: &Arc<Socket>) -> Option<Parking> {
        let parked = &self.parked;
        if parked.closed.load(Acquire) {
            return None;
        }
        let at = self.link.at.load(Acquire);
        if at == NONE || self.window.head() != Some(at) {
            return None;
        }
        self.link.state.store(PARKED, Release);
        let id = parked.next_id.fetch_add(1, Relaxed);
        let index = lock(parked.shard_of(id)).insert(ParkedSocket {
            id,
            stream: stream.clone(),
            link: self.link.clone(),
        });
        if parked.closed.load(Acquire) {
            // Closed meanwhile: the sweeper may have handed back everyone
            // before this one came.
            lock(parked.shard_of(id)).remove(index, id);
            self.link.state.store(ACTIVE, Release);
            return None;
        }
        if !parked.sweeping.swap(true, AcqRel) {
            tokio::spawn(sweeper(
                self.window.clone(),
                parked.clone(),
                self.metrics.clone(),
            ));
        }
        // A head published between the check and the insert may have been
        // swept without this subscriber: sweep again.
        if self.window.head() != Some(at) {
            parked.published();
        }
        self.metrics.subscriptions_parked.fetch_add(1, Relaxed);
        Some(Parking {
            id,
            index,
            handle: self.clone(),
        })
    }
}

impl Parking {
    /// Takes the subscription back from the sweep (for a heartbeat, a
    /// closing client, shutdown). `None` while the sweep is writing to it:
    /// wait for [`Parking::returned`] then.
    fn try_unpark(&self) -> Option<Back> {
        let link = &self.handle.link;
        match link.state.compare_exchange(PARKED, ACTIVE, AcqRel, Acquire) {
            Ok(_) => {
                self.remove();
                Some(Back::Resume { rest: None })
            }
            Err(RETURNED) => Some(self.take_back()),
            Err(_) => None,
        }
    }

    /// Takes the subscription back, waiting for the sweep if it is writing.
    pub async fn unpark(&self) -> Back {
        loop {
            if let Some(back) = self.try_unpark() {
                return back;
            }
            // The sweep is writing to this socket: one sendmsg, then it
            // sets PARKED or RETURNED.
            tokio::task::yield_now().await;
        }
    }

    /// Resolves when the sweep hands the subscription back.
    pub async fn returned(&self) -> Back {
        let link = &self.handle.link;
        loop {
            let notified = link.returned.notified();
            if link.state.load(Acquire) == RETURNED {
                return self.take_back();
            }
            notified.await;
        }
    }

    fn take_back(&self) -> Back {
        let link = &self.handle.link;
        link.state.store(ACTIVE, Release);
        self.remove();
        if link.broken.load(Acquire) {
            return Back::Broken;
        }
        Back::Resume {
            rest: lock(&link.rest).take(),
        }
    }

    fn remove(&self) {
        lock(self.handle.parked.shard_of(self.id)).remove(self.index, self.id);
    }
}

impl Drop for Parking {
    fn drop(&mut self) {
        // A task that ends while parked (its client went) leaves nothing behind.
        self.remove();
        self.handle
            .metrics
            .subscriptions_parked
            .fetch_sub(1, Relaxed);
    }
}

/// The sweeper of one window: a pass over its parked subscribers whenever
/// it has more, until it is over.
async fn sweeper(window: Arc<dyn Window>, parked: Arc<Parked>, metrics: Arc<Metrics>) {
    loop {
        parked.published.notified().await;
        let pass = if parked.closed.load(Acquire) {
            None
        } else {
            Pass::of(&*window)
        };
        let Some(pass) = pass else {
            parked.closed.store(true, Release);
            hand_back_all(&parked);
            return;
        };
        let started = std::time::Instant::now();
        let round = Arc::new(Round {
            window: window.clone(),
            latest: Mutex::new(Arc::new(pass)),
            metrics: metrics.clone(),
        });
        // The other shards in tasks of their own, which the runtime's idle
        // workers take; the first in this one. Empty shards need no task.
        let others: Vec<_> = (1..parked.shards.len())
            .filter(|&shard| !lock(&parked.shards[shard]).slots.is_empty())
            .map(|shard| tokio::spawn(sweep(parked.clone(), shard, round.clone())))
            .collect();
        sweep(parked.clone(), 0, round).await;
        for other in others {
            // A shard's task ends on its own; an error is the runtime
            // shutting down.
            let _ = other.await;
        }
        metrics
            .sweep_seconds
            .observe(started.elapsed().as_secs_f64());
    }
}

/// Hands every parked subscriber back to its task (the window is over).
fn hand_back_all(parked: &Parked) {
    for shard in parked.shards.iter() {
        let entries = lock(shard);
        for entry in entries.slots.iter().flatten() {
            let link = &entry.link;
            if link
                .state
                .compare_exchange(PARKED, WRITING, AcqRel, Acquire)
                .is_ok()
            {
                hand_back(link);
            }
        }
    }
}

/// One sweep of a window, shared by the tasks that write its shards.
struct Round {
    window: Arc<dyn Window>,
    /// The newest pass any of them took.
    latest: Mutex<Arc<Pass>>,
    metrics: Arc<Metrics>,
}

impl Round {
    /// Moves `pass` on to the window's head if it has moved on, with one new
    /// pass for all the shards; false when the window is over.
    fn catch_up(&self, pass: &mut Arc<Pass>) -> bool {
        let Some(head) = self.window.head() else {
            return true;
        };
        if head <= pass.head() {
            return true;
        }
        let mut latest = lock(&self.latest);
        if latest.head() < head {
            let Some(newer) = Pass::of(&*self.window) else {
                return false;
            };
            *latest = Arc::new(newer);
            self.metrics.sweep_head_changes_total.fetch_add(1, Relaxed);
        }
        *pass = latest.clone();
        true
    }
}

/// Writes the window's head to every subscriber of one shard not yet at it.
///
/// A head published while the sweep is under way is what the rest of the
/// sweep writes: a subscriber is always sent the newest state there is when
/// its turn comes, never one already superseded. Those the sweep passed
/// before the new head get it from the next sweep (the publish left its
/// wake-up). Without this, a sweep longer than the time between updates
/// sends the last subscribers a stale version, and the current one a whole
/// sweep later.
async fn sweep(parked: Arc<Parked>, shard: usize, round: Arc<Round>) {
    let mut pass = lock(&round.latest).clone();
    let mut tally = Tally::default();
    let mut next = 0;
    loop {
        if next > 0 && !round.catch_up(&mut pass) {
            // Over: the sweeper hands everyone back.
            break;
        }
        {
            let entries = lock(&parked.shards[shard]);
            let end = (next + SWEEP_BATCH).min(entries.slots.len());
            if next >= end {
                break;
            }
            for entry in entries.slots[next..end].iter().flatten() {
                deliver(entry, &pass, &mut tally);
            }
            next = end;
        }
        // Let the other tasks of this worker run during a long sweep.
        tokio::task::yield_now().await;
    }
    let metrics = &round.metrics;
    metrics.updates_sent_total.fetch_add(tally.updates, Relaxed);
    metrics
        .snapshots_sent_total
        .fetch_add(tally.snapshots, Relaxed);
    metrics.bytes_sent_total.fetch_add(tally.bytes, Relaxed);
}

/// What one sweep wrote, added to the metrics once at its end.
#[derive(Default)]
struct Tally {
    updates: u64,
    snapshots: u64,
    bytes: u64,
}

/// Writes the head to one parked subscriber, if it is parked and behind.
fn deliver(entry: &ParkedSocket, pass: &Pass, tally: &mut Tally) {
    let link = &entry.link;
    if link
        .state
        .compare_exchange(PARKED, WRITING, AcqRel, Acquire)
        .is_err()
    {
        return;
    }
    // Parked subscribers always have a position (see `Handle::park`).
    let at = link.at.load(Acquire);
    let head = pass.head();
    let step = if at == NONE || at >= head {
        Due::Stay
    } else {
        pass.step(at)
    };
    let (framed, updates, snapshot) = match step {
        Due::Stay => {
            link.state.store(PARKED, Release);
            return;
        }
        Due::HandBack => return hand_back(link),
        Due::Write {
            chunk,
            updates,
            snapshot,
        } => (chunk, updates, snapshot),
    };
    let sent = entry.stream.send_now(&framed);
    if matches!(sent, Ok(Sent { taken, .. }) if taken > 0) {
        tally.updates += updates;
        tally.snapshots += u64::from(snapshot);
    }
    match sent {
        Ok(Sent {
            taken,
            pending: false,
        }) if taken == framed.len() => {
            tally.bytes += taken as u64;
            link.direct_updates.fetch_add(updates, Relaxed);
            link.direct_bytes.fetch_add(taken as u64, Relaxed);
            link.at.store(head, Release);
            link.state.store(PARKED, Release);
        }
        Ok(Sent { taken, .. }) if taken > 0 => {
            // Begun: the rest (of the chunk, or over TLS of its encrypted
            // bytes) is the task's to write, and the client is at this
            // head once it has.
            tally.bytes += taken as u64;
            link.direct_updates.fetch_add(updates, Relaxed);
            link.direct_bytes.fetch_add(framed.len() as u64, Relaxed);
            link.at.store(head, Release);
            *lock(&link.rest) = (taken < framed.len()).then(|| framed.slice(taken..));
            hand_back(link);
        }
        Ok(_) => hand_back(link),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => hand_back(link),
        Err(_) => {
            link.broken.store(true, Release);
            hand_back(link);
        }
    }
}

fn hand_back(link: &Link) {
    link.state.store(RETURNED, Release);
    link.returned.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpStream;

    /// A window whose head moves when the test (or its first pass) says, and
    /// whose chunks name the step they take a subscriber through.
    #[derive(Default)]
    struct Moving {
        head: AtomicU64,
        passes: AtomicU64,
        parked: Arc<Parked>,
    }

    struct MovingPass {
        source: Arc<Moving>,
        head: u64,
        first: AtomicBool,
    }

    fn step_chunk(from: u64, to: u64) -> Bytes {
        chunk(format!("{from}->{to};").as_bytes())
    }

    impl Window for Arc<Moving> {
        fn name(&self) -> &str {
            "/moving"
        }
        fn head(&self) -> Option<u64> {
            Some(self.head.load(Acquire))
        }
        fn freeze(&self) -> Option<Box<dyn Frozen>> {
            let first = self.passes.fetch_add(1, AcqRel) == 0;
            Some(Box::new(MovingPass {
                source: self.clone(),
                head: self.head.load(Acquire),
                first: AtomicBool::new(first),
            }))
        }
    }

    impl Frozen for MovingPass {
        fn head(&self) -> u64 {
            self.head
        }
        fn step(&self, at: u64) -> window::Step {
            if self.first.swap(false, AcqRel) {
                // A newer version comes out as the first sweep begins.
                self.source.head.store(self.head + 1, Release);
                self.source.parked.published();
            }
            window::Step::Write {
                bytes: Bytes::from(format!("{at}->{};", self.head)),
                to: self.head,
                updates: 1,
                snapshot: false,
            }
        }
    }

    /// A window relayed as received: entries `first..head`, one per step.
    struct AsReceived {
        first: u64,
        head: u64,
    }

    impl Frozen for AsReceived {
        fn head(&self) -> u64 {
            self.head
        }
        fn step(&self, at: u64) -> window::Step {
            if at >= self.head {
                return window::Step::Stay;
            }
            if at < self.first {
                return window::Step::Lost;
            }
            window::Step::Write {
                bytes: Bytes::from(format!("e{at};")),
                to: at + 1,
                updates: 1,
                snapshot: false,
            }
        }
    }

    #[test]
    fn a_parked_laggard_is_written_the_entries_it_lacks_in_one_chunk() {
        let entries = AsReceived { first: 2, head: 5 };
        let (framed, updates, snapshot) = joined(&entries, 2).expect("within the window");
        assert_eq!(framed, chunk(b"e2;e3;e4;"));
        assert_eq!((updates, snapshot), (3, false));
        // One behind: its one entry, framed as it is.
        assert_eq!(joined(&entries, 4).expect("one").0, chunk(b"e4;"));
        // Fell out of the window: its task takes over (and ends it).
        assert!(joined(&entries, 1).is_none());
        // At the head: nothing.
        assert!(joined(&entries, 5).is_none());
    }

    async fn read_exactly(client: &mut TcpStream, len: usize) -> Vec<u8> {
        let mut got = vec![0; len];
        tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut got))
            .await
            .expect("the sweep wrote in time")
            .expect("read");
        got
    }

    #[tokio::test]
    async fn a_sweep_goes_on_with_a_head_published_while_it_runs() {
        head_published_during_a_sweep(1).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_shard_of_a_sweep_goes_on_with_the_newer_head() {
        head_published_during_a_sweep(2).await;
    }

    /// Parks subscribers at 0 and publishes 1, whose first pass publishes 2
    /// as it begins: what each one reads shows which version it was sent.
    async fn head_published_during_a_sweep(shards: usize) {
        let source = Arc::new(Moving::default());
        let dyn_source: Arc<dyn Window> = Arc::new(source.clone());
        let parked = source.parked.clone();
        assert_eq!(parked.shards.len(), shards, "one shard per worker");
        let metrics = Arc::new(Metrics::default());
        let (_closing_tx, closing) = watch::channel(false);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // Each shard: two batches and some more.
        let n = (SWEEP_BATCH * 2 + 5) * shards;
        let mut clients = Vec::with_capacity(n);
        let mut tickets = Vec::with_capacity(n);
        for _ in 0..n {
            let client = TcpStream::connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            let (server, _) = listener.accept().await.unwrap();
            let handle = Handle {
                window: dyn_source.clone(),
                parked: parked.clone(),
                link: Arc::new(Link::default()),
                metrics: metrics.clone(),
                heartbeat: None,
                closing: closing.clone(),
            };
            handle.link.at.store(0, Release);
            tickets.push(
                handle
                    .park(&Arc::new(Socket::Plain(server)))
                    .expect("caught up: parks"),
            );
            clients.push(client);
        }
        source.head.store(1, Release);
        parked.published();

        // The first batch of the shard that began (subscribers park into
        // the shards in turn) was written version 1, then version 2 by the
        // next sweep; everyone after the first batches went straight to
        // version 2. Another shard's first batch has either, as its task
        // began before or after the newer pass.
        let passed: Vec<u8> = [step_chunk(0, 1), step_chunk(1, 2)].concat();
        let straight = step_chunk(0, 2);
        let mut were_passed = vec![false; shards];
        for (i, client) in clients.iter_mut().enumerate() {
            let got = read_exactly(client, straight.len()).await;
            let shard = i % shards;
            let first_batch = i < SWEEP_BATCH * shards;
            if got == straight {
                assert!(
                    !(first_batch && were_passed[shard]),
                    "subscriber {i}: the rest of its shard's first batch was sent 1"
                );
                continue;
            }
            assert!(first_batch, "subscriber {i}: {got:?}");
            if i < shards {
                were_passed[shard] = true;
            }
            assert!(were_passed[shard], "subscriber {i}: its shard began on 2");
            let rest = read_exactly(client, passed.len() - got.len()).await;
            assert_eq!([got, rest].concat(), passed, "subscriber {i}");
        }
        let passed_shards = were_passed.iter().filter(|&&p| p).count();
        assert!(passed_shards >= 1, "the shard that began was sent 1");
        if shards == 1 {
            assert!(were_passed[0]);
        }
        // The sweep records where a subscriber is after its write, which
        // the client may have read first: wait (bounded) for it.
        for (i, ticket) in tickets.iter().enumerate() {
            for _ in 0..100 {
                if ticket.handle.link.at.load(Acquire) == 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(ticket.handle.link.at.load(Acquire), 2, "subscriber {i}");
        }
        // Nothing else follows.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (i, client) in clients.iter().enumerate() {
            let mut byte = [0u8; 1];
            let extra = client.try_read(&mut byte);
            assert!(
                matches!(&extra, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
                "subscriber {i} read more: {extra:?}"
            );
        }
        // One new pass for all the shards.
        assert_eq!(metrics.sweep_head_changes_total.load(Relaxed), 1);
        assert_eq!(
            metrics.updates_sent_total.load(Relaxed),
            (n + SWEEP_BATCH * passed_shards) as u64
        );
    }
}
