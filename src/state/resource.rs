//! Versioned resources: the registry URL → [`Resource`], each with its
//! current state ([`Head`]), a bounded history window, and the watch
//! channel that wakes its subscribers. How changes are learned lives in
//! [`crate::feed::poll`]; this module only records them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use moka::sync::Cache;
use tokio::sync::{watch, Notify};

use super::key::Key;
use super::said::State;
use super::stored::{header_bytes, AnswerRules, Stored};
use super::version::{hashed_version, same_strong, version_of};
use crate::braid::{self, Patch, Update, VersionList};
use crate::diff;
use crate::error::Refusal;
use crate::floor::rules::Vary;
use crate::floor::sync::lock;
use crate::metrics::Metrics;

/// A resource's current version, shared by every subscriber.
#[derive(Debug)]
pub struct Head {
    /// Position in the resource's history; 0 before the first fetch.
    pub seq: u64,
    pub version: VersionList,
    pub state: State,
    /// `sha-256=:<base64>:` of the body.
    pub digest: String,
    /// The encoded update from `seq - 1` to `seq`, shared by all subscribers.
    pub update: Option<Bytes>,
    snapshot: OnceLock<Bytes>,
    /// The registry total its frames (update and snapshot) are counted in,
    /// each for as long as any copy of it lives: a frame a slow subscriber
    /// is still being written stays counted after the head is replaced
    /// (`None` before the first state).
    counter: Option<Arc<std::sync::atomic::AtomicUsize>>,
    /// When this head was published.
    pub at: Instant,
}

impl Head {
    fn unknown() -> Head {
        Head {
            seq: 0,
            version: VersionList::default(),
            state: State::Unknown,
            digest: String::new(),
            update: None,
            snapshot: OnceLock::new(),
            counter: None,
            at: Instant::now(),
        }
    }

    /// The status a subscriber's update for this state carries, if not 200.
    pub fn status(&self) -> Option<u16> {
        match &self.state {
            State::Present { .. } | State::Unknown => None,
            State::Missing { status }
            | State::Error { status, .. }
            | State::Denied { status, .. } => Some(*status),
        }
    }

    /// The body of this state (empty when missing).
    pub fn body(&self) -> Bytes {
        match &self.state {
            State::Present { body, .. } | State::Denied { body, .. } => body.clone(),
            State::Error { reason, .. } => Bytes::from(format!("{reason}\n")),
            _ => Bytes::new(),
        }
    }

    /// The whole state as one update, encoded once per head (and counted
    /// while any copy of it lives, see [`Head::counter`]).
    pub fn snapshot(&self) -> Bytes {
        self.snapshot
            .get_or_init(|| {
                let encoded = braid::encode(&Update {
                    status: self.status(),
                    version: self.version.clone(),
                    parents: VersionList::default(),
                    body: braid::Body::Snapshot(self.body()),
                    extra_headers: self.snapshot_headers(),
                });
                match &self.counter {
                    Some(total) => super::polled::held_bytes(encoded, total),
                    None => encoded,
                }
            })
            .clone()
    }

    /// The headers a snapshot of this state carries: the representation
    /// headers that describe its body, `Content-Type` and
    /// `Content-Language` (so a proxy following this one learns them with
    /// the body; a coded body is never a Braid state), a denial's own
    /// headers ([`DENIAL_HEADERS`]), and `Repr-Digest`.
    fn snapshot_headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        let mut headers = Vec::new();
        if let State::Denied { headers: kept, .. } = &self.state {
            headers.extend(kept.iter().cloned());
        }
        if let State::Present {
            content_type,
            language,
            ..
        } = &self.state
        {
            for (name, value) in [
                (http::header::CONTENT_TYPE, content_type),
                (http::header::CONTENT_LANGUAGE, language),
            ] {
                if let Some(v) = value.as_deref().and_then(|v| HeaderValue::from_str(v).ok()) {
                    headers.push((name, v));
                }
            }
        }
        if let Ok(v) = HeaderValue::from_str(&self.digest) {
            if !self.digest.is_empty() {
                headers.push((HeaderName::from_static("repr-digest"), v));
            }
        }
        headers
    }
}

/// A new state to publish, as the watcher learned it.
#[derive(Debug)]
pub struct Change {
    pub state: State,
    /// The version the upstream named (a Braid upstream's `Version`); `None`
    /// derives it from the strong ETag or the content.
    pub version: Option<VersionList>,
    /// The upstream's patches from the current head to `state`, when it sent
    /// patches whose parents are the current head; `None` diffs locally.
    pub patches: Option<Vec<Patch>>,
}

impl Change {
    /// A state whose version is derived from its ETag or content.
    pub fn derived(state: State) -> Change {
        Change {
            state,
            version: None,
            patches: None,
        }
    }
}

/// One step of history: how to go from `seq - 1` to `seq`.
struct HistoryStep {
    /// `None` when the step cannot be expressed as patches (status change, snapshot).
    patches: Option<Arc<Vec<Patch>>>,
    weight: u32,
}

/// The per-resource index of the history window; the steps themselves live
/// in the shared, byte-weighted [`History`] cache so one total bounds them all.
#[derive(Default)]
struct Recent {
    /// (seq, version) of the retained steps, oldest first.
    versions: VecDeque<(u64, VersionList)>,
    bytes: usize,
    weights: VecDeque<u32>,
}

/// The history shared by all resources, bounded by `--history-bytes`.
pub struct History {
    steps: Cache<(u64, u64), Arc<HistoryStep>>,
    evicted: Arc<std::sync::atomic::AtomicU64>,
    catch_ups: Cache<(u64, u64, u64), Bytes>,
    per_resource_len: usize,
    per_resource_bytes: usize,
}

impl History {
    pub fn new(total_bytes: u64, per_resource_len: usize) -> History {
        let evicted = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let count = evicted.clone();
        let steps = Cache::builder()
            .max_capacity(total_bytes)
            .weigher(|_, step: &Arc<HistoryStep>| step.weight)
            .eviction_listener(move |_, _, cause| {
                if cause == moka::notification::RemovalCause::Size {
                    count.fetch_add(1, Relaxed);
                }
            })
            .build();
        let catch_ups = Cache::builder()
            .max_capacity((total_bytes / 4).max(1024 * 1024))
            .weigher(|_, bytes: &Bytes| u32::try_from(bytes.len()).unwrap_or(u32::MAX))
            .build();
        History {
            steps,
            evicted,
            catch_ups,
            per_resource_len,
            per_resource_bytes: usize::try_from(total_bytes).unwrap_or(usize::MAX),
        }
    }

    /// Bytes currently held by all windows and the collapsed updates
    /// kept for laggards.
    pub fn weighted_size(&self) -> u64 {
        self.steps.weighted_size() + self.catch_ups.weighted_size()
    }

    /// Steps evicted from the windows to keep them under `--history-bytes`.
    pub fn evictions(&self) -> u64 {
        self.evicted.load(Relaxed)
    }
}

/// Tunables a resource needs when it records a change.
pub struct Tuning {
    pub diff_timeout: Duration,
    pub snapshot_ratio: f64,
}

/// One resource: its current state, window, subscribers' channel, and the
/// handle its watcher is woken by.
pub struct Resource {
    id: u64,
    pub(super) key: String,
    /// Where the registry keeps it. One lock: the registry changes these
    /// together (under its own lock), and they are read rarely.
    pub(super) placement: Mutex<Placement>,
    /// The request headers its watcher sends upstream: the creating
    /// request's end-to-end headers and forwarding headers.
    pub template: HeaderMap,
    /// Keyed by credentials, or detached: counted as private.
    pub private: bool,
    /// What its upstream is, as learned from its own answers ([`Kind`]).
    kind: std::sync::atomic::AtomicU8,
    /// The current state: a watch, so subscribers wake on a new head
    /// and read it without a lock.
    head: watch::Sender<Arc<Head>>,
    /// The origin's last answer to a GET and what it said about sharing.
    /// One lock: both are recorded from the same answer. Read on every
    /// plain GET, held only to clone an `Arc`.
    answer: Mutex<Answer>,
    /// Held while a request fetches this variant from the origin, so that
    /// concurrent requests that need the origin share one request.
    pub fetching: Arc<tokio::sync::Mutex<()>>,
    /// Set while a watcher task runs for this resource.
    pub(super) watching: std::sync::atomic::AtomicBool,
    /// Set when the origin's last answer could not be stored: requests then
    /// go to the origin without waiting on each other.
    pub uncacheable: std::sync::atomic::AtomicBool,
    /// Set when it was taken out of the registry (its first answer showed it
    /// is not shareable under its key): only its current subscribers use it.
    pub(super) detached: std::sync::atomic::AtomicBool,
    /// Bytes counted for this resource in the registry's total.
    pub(super) weight: std::sync::atomic::AtomicUsize,
    /// Set when the registry dropped it: its bytes are no longer counted.
    pub(super) gone: std::sync::atomic::AtomicBool,
    total: Arc<std::sync::atomic::AtomicUsize>,
    /// The index of its history steps. Its own lock: changed by each
    /// publish (under `publishing`) and read by laggards' catch-ups, which
    /// must not wait on an origin answer being recorded.
    window: Mutex<Recent>,
    /// Wakes the watcher for an immediate revalidation.
    pub wake: Notify,
    /// What its watcher's next poll must be, and how often it asks.
    polling: Polling,
    /// Bumped after every revalidation attempt, successful or not.
    validated: watch::Sender<Validation>,
    /// When a request last used it, for eviction. Its own lock: touched by
    /// every request, so it shares it with nothing.
    pub(super) last_used: Mutex<Instant>,
    /// Held while an origin answer is recorded (watcher, GETs and writes
    /// all record): the ticket of the newest answer recorded, or of the
    /// latest write's landing. An answer with an older ticket is not.
    publishing: Mutex<Ticket>,
    /// Its parked HTTP/1.1 subscribers, written to directly on each change.
    pub direct: Arc<crate::deliver::direct::Parked>,
    /// Its window as subscribers follow it: one for all of them.
    pub(super) followed: OnceLock<Arc<dyn crate::deliver::window::Window>>,
}

/// Where the registry keeps a resource ([`Resource::placement`]).
pub(super) struct Placement {
    /// The variant within the URL: forwarded host, Vary values,
    /// credentials; and the `Vary` it was computed under. Changed only by
    /// [`super::Registry::rekey`], under the registry's lock.
    pub(super) variant: (String, Vary),
    /// Its slot under `--max-private-resources`, held while it is tracked
    /// and given back once, when it is dropped (see [`PrivateSlot`]).
    pub(super) slot: Option<PrivateSlot>,
    /// Why it could not be tracked, for the requests waiting on its first
    /// state (the private cap): they get this rather than a bare 502.
    pub(super) refused: Option<String>,
}

/// The origin's last answer ([`Resource::answer`]).
struct Answer {
    /// Its answer to a GET, for plain GETs (RFC 9111).
    stored: Option<Arc<Stored>>,
    /// What it said about sharing, passed on to downstream tiers with
    /// every 209 (spec/braid-wire.md §5.1).
    rules: AnswerRules,
}

impl Drop for Resource {
    /// Ends the resource's direct-delivery sweeper, if one runs.
    fn drop(&mut self) {
        self.direct.close();
    }
}

/// Marks the watcher reads before each poll ([`Resource::polling`]).
#[derive(Debug, Default)]
struct Polling {
    /// Set by a refresh: the next poll is unconditional (an origin whose
    /// validator does not change with its body is still heard).
    refetch: std::sync::atomic::AtomicBool,
    /// The watcher's current interval in milliseconds (0: not polling),
    /// for `/status`.
    interval_ms: AtomicU64,
}

/// The outcome of the latest revalidation.
#[derive(Debug, Clone, Default)]
pub struct Validation {
    /// Bumped after every attempt, successful or not.
    pub generation: u64,
    /// When the request of the latest answered revalidation was sent: an
    /// answer is as current as its request, not as its arrival.
    pub sent_at: Option<std::time::SystemTime>,
    /// When the upstream last answered a revalidation: any well-formed
    /// answer but a 5xx (a 401, 403, 404 or 410 about one client's
    /// request is the upstream answering). What readiness reads
    /// ([`Resource::unheard`]).
    pub answered_at: Option<Instant>,
}

/// How long a subscribed resource may go without an answer from its
/// upstream before `/readyz` turns red: three of its longest poll
/// intervals (`--poll-max-interval`: a quiet resource is polled that
/// seldom), at least 3 s.
pub fn unheard_limit(poll_ceiling: Duration) -> Duration {
    poll_ceiling.max(Duration::from_secs(1)) * 3
}

/// Numbers the requests sent to origins, in the order they are sent
/// (one counter for the process: a resource made after its request was
/// sent still orders that request's answer among the others).
static TICKETS: AtomicU64 = AtomicU64::new(0);

/// The place of one origin request in the order requests were sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

impl Ticket {
    /// Taken just before a request goes to the origin.
    pub fn take() -> Ticket {
        Ticket(TICKETS.fetch_add(1, Relaxed) + 1)
    }
}

/// An origin answer being recorded into a resource (see [`Resource::record`]).
pub struct Recording<'a> {
    resource: &'a Resource,
    _newest: MutexGuard<'a, Ticket>,
}

impl Recording<'_> {
    /// Records a new state learned from the upstream. Returns false when
    /// it is the version already current (nothing to publish).
    pub fn publish(
        &self,
        change: Change,
        history: &History,
        tuning: &Tuning,
        metrics: &Metrics,
    ) -> bool {
        self.resource
            .publish_locked(change, false, history, tuning, metrics)
    }
}

impl Resource {
    pub(super) fn new(
        id: u64,
        key: Key,
        template: HeaderMap,
        private: bool,
        total: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Resource {
        let weight =
            key.path.len() + key.secondary.len() + RESOURCE_OVERHEAD + header_bytes(&template);
        total.fetch_add(weight, Relaxed);
        Resource {
            id,
            key: key.path,
            placement: Mutex::new(Placement {
                variant: (key.secondary, key.vary.clone()),
                slot: None,
                refused: None,
            }),
            template,
            private,
            kind: (Kind::Unknown as u8).into(),
            head: watch::channel(Arc::new(Head::unknown())).0,
            answer: Mutex::new(Answer {
                stored: None,
                rules: AnswerRules {
                    vary: key.vary.clone(),
                    personal: false,
                },
            }),
            fetching: Arc::default(),
            watching: false.into(),
            uncacheable: false.into(),
            detached: false.into(),
            weight: weight.into(),
            gone: false.into(),
            total,
            window: Mutex::default(),
            wake: Notify::new(),
            polling: Polling::default(),
            validated: watch::channel(Validation::default()).0,
            last_used: Mutex::new(Instant::now()),
            publishing: Mutex::new(Ticket(0)),
            direct: Arc::default(),
            followed: OnceLock::new(),
        }
    }

    /// The registry's count of held bytes, for copies made from this
    /// resource that outlive a call (they add and remove themselves).
    pub fn held(&self) -> Arc<std::sync::atomic::AtomicUsize> {
        self.total.clone()
    }

    /// Its number, unique in the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the registry dropped it (evicted, refused or idle).
    pub fn is_gone(&self) -> bool {
        self.gone.load(Relaxed)
    }

    /// The upstream path and query of this resource.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The origin's last storable answer to a GET of this variant.
    pub fn stored(&self) -> Option<Arc<Stored>> {
        lock(&self.answer).stored.clone()
    }

    /// Replaces the stored answer (a 200, a 304's update, or another
    /// storable status) and recounts the bytes held.
    pub fn set_stored(&self, stored: Option<Stored>) {
        lock(&self.answer).stored = stored.map(Arc::new);
        self.reweigh();
    }

    /// Marks the stored answer as needing revalidation before reuse.
    pub fn invalidate(&self) {
        let mut answer = lock(&self.answer);
        if let Some(stored) = answer.stored.as_ref() {
            let mut copy = Stored::clone(stored);
            copy.invalid = true;
            answer.stored = Some(Arc::new(copy));
        }
    }

    /// Recounts this resource's bytes in the total: key, the request
    /// headers its watcher sends, head body, the stored answer's headers,
    /// and its body when it is not the head's. The head's frames (its
    /// update and, once built, its snapshot) count themselves, for as long
    /// as any copy lives ([`Head::counter`]).
    pub(crate) fn reweigh(&self) {
        let head = self.head();
        let head_body = head.body();
        let stored_len = match lock(&self.answer).stored.as_ref() {
            // Its headers are held twice once served: as stored, and as
            // the prepared answer built from them.
            Some(s) => {
                let body = if s.body.as_ptr() != head_body.as_ptr() {
                    s.body.len()
                } else {
                    0
                };
                body + 2 * header_bytes(&s.headers)
            }
            None => 0,
        };
        // The head's frames count themselves (Head::counter).
        let weight = self.key.len()
            + lock(&self.placement).variant.0.len()
            + RESOURCE_OVERHEAD
            + header_bytes(&self.template)
            + head_body.len()
            + stored_len;
        if self.gone.load(Relaxed) {
            return;
        }
        let old = self.weight.swap(weight, Relaxed);
        if weight >= old {
            self.total.fetch_add(weight - old, Relaxed);
        } else {
            self.total.fetch_sub(old - weight, Relaxed);
        }
    }

    /// Records that a write through the proxy has just landed at the
    /// origin: answers to requests sent before now may show the document
    /// from before the write, and are not recorded.
    pub fn landed(&self) {
        let mut newest = lock(&self.publishing);
        *newest = (*newest).max(Ticket::take());
    }

    /// Begins recording the answer to the request that took `ticket`;
    /// `None` when an answer to a later request (or a later write) is
    /// already recorded. Others wait until the returned value is dropped.
    pub fn record(&self, ticket: Ticket) -> Option<Recording<'_>> {
        let mut newest = lock(&self.publishing);
        if ticket < *newest {
            return None;
        }
        *newest = ticket;
        Some(Recording {
            resource: self,
            _newest: newest,
        })
    }

    /// What its upstream is, as far as its own answers tell.
    pub fn kind(&self) -> Kind {
        match self.kind.load(Relaxed) {
            1 => Kind::Plain,
            2 => Kind::Braid,
            _ => Kind::Unknown,
        }
    }

    /// Records what its upstream is; a Braid answer is never unlearned by
    /// a later plain one (a Braid server's 404 may carry no Braid header).
    pub fn learn_kind(&self, kind: Kind) {
        match kind {
            Kind::Unknown => {}
            Kind::Braid => self.kind.store(Kind::Braid as u8, Relaxed),
            Kind::Plain => {
                let _ = self.kind.compare_exchange(
                    Kind::Unknown as u8,
                    Kind::Plain as u8,
                    Relaxed,
                    Relaxed,
                );
            }
        }
    }

    /// Why this resource could not be tracked, if it could not.
    pub fn refusal(&self) -> Option<Refusal> {
        lock(&self.placement)
            .refused
            .clone()
            .map(|reason| Refusal::Unavailable {
                reason,
                retry_after: Duration::from_secs(5),
            })
    }

    /// Whether the resource was taken out of the registry.
    pub fn is_detached(&self) -> bool {
        self.detached.load(Relaxed)
    }

    /// The variant within its URL: the secondary key (host, the values of
    /// the request headers its `Vary` names, a credential's digest).
    pub fn variant(&self) -> String {
        lock(&self.placement).variant.0.clone()
    }

    /// The `Vary` its key was computed under.
    pub fn vary(&self) -> Vary {
        lock(&self.placement).variant.1.clone()
    }

    /// Records what the origin's latest answer said about sharing.
    pub fn set_answer_rules(&self, rules: AnswerRules) {
        lock(&self.answer).rules = rules;
    }

    /// What the origin's latest answer said about sharing.
    pub fn answer_rules(&self) -> AnswerRules {
        lock(&self.answer).rules.clone()
    }

    /// The current head.
    pub fn head(&self) -> Arc<Head> {
        self.head.borrow().clone()
    }

    /// A receiver woken on every new head. Holding one makes a subscriber.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Head>> {
        self.head.subscribe()
    }

    /// Number of live subscribers.
    pub fn subscribers(&self) -> usize {
        self.head.receiver_count()
    }

    pub fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }

    /// How long since a request last used this resource.
    pub fn idle_for(&self) -> Duration {
        lock(&self.last_used).elapsed()
    }

    /// The latest revalidation outcome.
    pub fn validation(&self) -> Validation {
        self.validated.borrow().clone()
    }

    /// A receiver of revalidation outcomes.
    pub fn validations(&self) -> watch::Receiver<Validation> {
        self.validated.subscribe()
    }

    /// Wakes the watcher for a revalidation now (write-through, a new
    /// subscriber); stored answers are invalidated by [`Resource::invalidate`].
    pub fn refresh(&self) {
        self.wake.notify_one();
    }

    /// The refresh hook: the watcher's next poll is unconditional (it
    /// fetches the body whatever the validators say), and comes now.
    pub fn refetch(&self) {
        self.polling.refetch.store(true, Relaxed);
        self.wake.notify_one();
    }

    /// Whether the next poll must be unconditional; clears the mark.
    pub fn take_refetch(&self) -> bool {
        self.polling.refetch.swap(false, Relaxed)
    }

    /// Records the watcher's current interval (`None`: it does not poll).
    pub fn set_poll_interval(&self, interval: Option<Duration>) {
        let ms = interval.map_or(0, |d| (d.as_millis() as u64).max(1));
        self.polling.interval_ms.store(ms, Relaxed);
    }

    /// The watcher's current interval, while it polls.
    pub fn poll_interval(&self) -> Option<Duration> {
        match self.polling.interval_ms.load(Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Records the end of a revalidation attempt; `answered`: the
    /// upstream answered it, to the request sent then (see
    /// [`Validation::answered_at`]).
    pub fn validated(&self, answered: Option<std::time::SystemTime>) {
        self.validated.send_modify(|v| {
            v.generation += 1;
            if let Some(sent) = answered {
                v.answered_at = Some(Instant::now());
                v.sent_at = Some(v.sent_at.map_or(sent, |s| s.max(sent)));
            }
        });
    }

    /// The readiness rule, the one place it is written: the resource has
    /// subscribers and its upstream has not answered it for `limit`
    /// ([`unheard_limit`]): its watcher is wedged or the upstream fails.
    /// An answer about one client's request (401, 403, 404, 410, any 4xx)
    /// is an answer; no answer, a broken one or a 5xx is not.
    pub fn unheard(&self, limit: Duration) -> bool {
        self.subscribers() > 0
            && self
                .validation()
                .answered_at
                .is_none_or(|at| at.elapsed() > limit)
    }

    /// The history position of a version, if it is the head or still in the window.
    pub fn seq_of(&self, version: &VersionList) -> Option<u64> {
        let head = self.head();
        if head.seq > 0 && &head.version == version {
            return Some(head.seq);
        }
        let window = lock(&self.window);
        window
            .versions
            .iter()
            .rev()
            .find(|(_, v)| v == version)
            .map(|(s, _)| *s)
    }

    /// Records the result of a write made against `parents`, only if the
    /// head is still that version; false (nothing recorded) otherwise. The
    /// writer's patches are sent as they are, even when a snapshot would
    /// be smaller: they say how the document changed.
    pub fn publish_on(
        &self,
        parents: &VersionList,
        change: Change,
        history: &History,
        tuning: &Tuning,
        metrics: &Metrics,
    ) -> bool {
        let _one = lock(&self.publishing);
        self.head().version == *parents
            && self.publish_locked(change, true, history, tuning, metrics)
    }

    fn publish_locked(
        &self,
        change: Change,
        as_sent: bool,
        history: &History,
        tuning: &Tuning,
        metrics: &Metrics,
    ) -> bool {
        let previous = self.head();
        let Change {
            state,
            version,
            patches: upstream_patches,
        } = change;
        let (derived, digest) = version_of(&state);
        let named = version.filter(|v| !v.is_empty());
        // A strong ETag names one representation (RFC 9110 §8.8.1): seen
        // again, it is the version held, whatever id that was published
        // under (a patch write keeps the writer's id).
        if named.is_none() && previous.seq > 0 && same_strong(&previous.state, &state) {
            return false;
        }
        let derived_only = named.is_none();
        let mut version = named.unwrap_or(derived);
        if derived_only
            && previous.seq > 0
            && matches!(state, State::Present { .. })
            && previous.digest != digest
            && self.seq_of(&version).is_some()
        {
            // The origin named another body with this ETag already (it kept
            // its ETag while the body changed): its content names this one.
            version = hashed_version(&state);
        }
        if previous.seq > 0 && previous.version == version {
            return false;
        }
        let budget =
            |body_len: usize| (snapshot_wire_len(body_len) as f64 * tuning.snapshot_ratio) as usize;
        let patches = match (&previous.state, &state, upstream_patches) {
            // The upstream's own patches, against the version we have: kept as sent.
            (State::Present { .. }, State::Present { body: new, .. }, Some(patches))
                if previous.seq > 0 =>
            {
                (as_sent || within(&patches, budget(new.len()))).then_some(patches)
            }
            (
                State::Present {
                    body: old,
                    content_type: old_ct,
                    ..
                },
                State::Present {
                    body: new,
                    content_type: new_ct,
                    ..
                },
                _,
            ) if old_ct == new_ct => {
                Metrics::inc(&metrics.diffs_total);
                let text = new_ct.as_deref().is_some_and(diff::is_text_content_type);
                let deadline = Instant::now() + tuning.diff_timeout;
                let outcome = diff::diff(old, new, text, deadline);
                if outcome.timed_out || !within(&outcome.patches, budget(new.len())) {
                    Metrics::inc(&metrics.diffs_fallback_snapshot_total);
                    None
                } else {
                    Some(outcome.patches)
                }
            }
            _ => None,
        };
        let seq = previous.seq + 1;
        let mut head = Head {
            seq,
            version,
            state,
            digest,
            update: None,
            snapshot: OnceLock::new(),
            counter: Some(self.total.clone()),
            at: Instant::now(),
        };
        let frame = match &patches {
            // The first state has no parent: every subscriber starts from a
            // snapshot, built when the first one needs it.
            _ if previous.seq == 0 => None,
            Some(patches) => Some(braid::encode(&Update {
                status: head.status(),
                version: head.version.clone(),
                parents: previous.version.clone(),
                body: braid::Body::Patches(patches.clone()),
                extra_headers: Vec::new(),
            })),
            None => Some(braid::encode(&Update {
                status: head.status(),
                version: head.version.clone(),
                parents: previous.version.clone(),
                body: braid::Body::Snapshot(head.body()),
                extra_headers: head.snapshot_headers(),
            })),
        };
        head.update = frame.map(|f| super::polled::held_bytes(f, &self.total));
        self.remember(seq, &head.version, patches, history);
        Metrics::inc(&metrics.updates_published_total);
        self.head.send_replace(Arc::new(head));
        self.direct.published();
        self.reweigh();
        true
    }

    /// Keeps the step to `seq` in the window: its patches, weighed by what
    /// they hold (its frame is the head's while it is the head, and counted
    /// there).
    fn remember(
        &self,
        seq: u64,
        version: &VersionList,
        patches: Option<Vec<Patch>>,
        history: &History,
    ) {
        let patch_bytes: usize = patches
            .iter()
            .flatten()
            .map(|p| p.content.len() + p.range.len() + 48)
            .sum();
        let weight = u32::try_from(patch_bytes + 64).unwrap_or(u32::MAX);
        history.steps.insert(
            (self.id, seq),
            Arc::new(HistoryStep {
                patches: patches.map(Arc::new),
                weight,
            }),
        );
        let mut window = lock(&self.window);
        window.versions.push_back((seq, version.clone()));
        window.weights.push_back(weight);
        window.bytes += weight as usize;
        while window.versions.len() > history.per_resource_len
            || window.bytes > history.per_resource_bytes
        {
            let (Some((old_seq, _)), Some(w)) =
                (window.versions.pop_front(), window.weights.pop_front())
            else {
                break;
            };
            window.bytes -= w as usize;
            history.steps.invalidate(&(self.id, old_seq));
        }
    }

    /// One update taking a subscriber from `from` (a seq in the window) to
    /// `head`: the patches of every step composed, or `None` when some step
    /// is gone from the window or cannot be composed (then send a snapshot).
    /// Cached per (from, head) so that laggards at the same place share it.
    pub fn catch_up(
        &self,
        from: u64,
        head: &Head,
        history: &History,
        metrics: &Metrics,
    ) -> Option<Bytes> {
        let key = (self.id, from, head.seq);
        if let Some(bytes) = history.catch_ups.get(&key) {
            return Some(bytes);
        }
        let parents = {
            let window = lock(&self.window);
            window
                .versions
                .iter()
                .find(|(s, _)| *s == from)
                .map(|(_, v)| v.clone())?
        };
        let mut composed: Option<Vec<Patch>> = None;
        for seq in from + 1..=head.seq {
            let step = history.steps.get(&(self.id, seq))?;
            let patches = step.patches.as_ref()?;
            composed = Some(match composed {
                None => patches.as_ref().clone(),
                Some(done) => braid::compose(&done, patches).ok()?,
            });
        }
        let patches = composed?;
        if !within(&patches, snapshot_wire_len(head.body().len())) {
            return None;
        }
        let bytes = braid::encode(&Update {
            status: head.status(),
            version: head.version.clone(),
            parents,
            body: braid::Body::Patches(patches),
            extra_headers: Vec::new(),
        });
        history.catch_ups.insert(key, bytes.clone());
        Metrics::inc(&metrics.collapsed_total);
        Some(bytes)
    }
}

/// Whether patches are worth sending instead of a snapshot: at most
/// `budget` bytes on the wire and at most [`braid::MAX_PATCHES`] of them.
fn within(patches: &[Patch], budget: usize) -> bool {
    patches.len() <= braid::MAX_PATCHES && braid::patches_wire_len(patches) <= budget
}

/// About how many bytes a snapshot of a body this long takes on the wire
/// (framing, `Content-Type` and `Repr-Digest` included).
fn snapshot_wire_len(body_len: usize) -> usize {
    body_len + 128
}

/// One resource's place under `--max-private-resources`: taken by
/// [`Registry::reserve_private`], given back when dropped, so it is given
/// back exactly once whatever path drops the resource.
pub(super) struct PrivateSlot {
    pub(super) count: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for PrivateSlot {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Relaxed);
    }
}

/// Bytes a resource costs beyond its key, headers and bodies, for the
/// state cap: the resource itself, its channels and locks, its history
/// step and registry entry. Measured: a dhat profile of 1,000 `Vary`'d
/// variants of 14 KB held 19.8 KB each, of which about 3.9 KB was none of
/// body, key or headers (BENCHMARKS.md, "Issue 44's shapes").
pub(super) const RESOURCE_OVERHEAD: usize = 4096;

/// What a resource's upstream is, learned per resource from its own answers
/// (`--upstream-kind` forces one for all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// No answer has told yet.
    Unknown = 0,
    /// A plain origin: polled, written through, patches applied here.
    Plain = 1,
    /// A Braid server: its subscriptions are relayed (and understood).
    Braid = 2,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::repr_digest;

    #[test]
    fn a_frame_still_being_written_stays_counted_after_its_head_is_replaced() {
        let total = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let key = Key {
            path: "/doc".into(),
            secondary: String::new(),
            vary: Vary::default(),
        };
        let r = Resource::new(1, key, HeaderMap::new(), false, total.clone());
        let (history, metrics) = (History::new(1 << 20, 16), Metrics::default());
        let tuning = Tuning {
            diff_timeout: Duration::from_millis(50),
            snapshot_ratio: 0.9,
        };
        let present = |fill: u8| State::Present {
            body: Bytes::from(vec![fill; 256 * 1024]),
            content_type: None,
            etag: None,
            language: None,
        };
        let publish = |state| {
            let recording = r.record(Ticket::take()).expect("newest");
            assert!(recording.publish(Change::derived(state), &history, &tuning, &metrics));
        };
        publish(present(b'a'));
        // A slow subscriber is being written the whole first state.
        let being_written = r.head().snapshot();
        let with_it = total.load(Relaxed);
        assert!(with_it >= 2 * 256 * 1024, "body and snapshot: {with_it}");
        // Two new versions replace it; every byte of each differs, so each
        // update is a snapshot of its own.
        publish(present(b'b'));
        publish(present(b'c'));
        let counted = total.load(Relaxed);
        // The current body and its update, and the first snapshot the
        // subscriber still holds.
        assert!(counted >= 3 * 256 * 1024, "{counted}");
        drop(being_written);
        let after = total.load(Relaxed);
        assert!(
            counted - after >= 256 * 1024,
            "the frame is uncounted once written: {counted} -> {after}"
        );
    }

    #[test]
    fn repr_digest_covers_the_bytes_sent() {
        let (_, present) = version_of(&State::Present {
            body: Bytes::from_static(b"hello"),
            content_type: None,
            etag: None,
            language: None,
        });
        assert_eq!(present, repr_digest(b"hello"));
        let (missing_version, missing) = version_of(&State::Missing { status: 404 });
        assert_eq!(
            missing,
            "sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:"
        );
        // The version of a missing state still depends on its status.
        let (gone_version, _) = version_of(&State::Missing { status: 410 });
        assert_ne!(missing_version, gone_version);
        let (_, error) = version_of(&State::Error {
            status: 502,
            reason: "too big".into(),
        });
        assert_eq!(error, repr_digest(b"too big\n"));
    }
}
