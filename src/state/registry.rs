//! The registry of tracked resources: URL → variants → [`Resource`], with
//! the keys requests and feeds share ([`Registry::key_for`]), the private
//! slots, and the `--state-bytes` cap with its eviction and refusals.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderMap;

use super::key::Key;
use super::resource::{Kind, PrivateSlot, Resource};
use crate::error::Refusal;
use crate::floor::rules::{self, Vary};
use crate::floor::sync::lock;
use crate::metrics::Metrics;

/// The variants of one URL, and the `Vary` its origin last answered with.
#[derive(Default)]
struct Variants {
    vary: Vary,
    /// A Braid server answered for this URL (a 209, or Braid headers):
    /// its answers are relayed, never polled, even a 404 without them.
    braid: bool,
    /// A variant of this URL was answered by a plain origin: its variants
    /// not known yet are taken to be plain too (one handler answers them).
    /// A hint, gone with the URL's last variant.
    plain: bool,
    by_key: HashMap<String, Arc<Resource>>,
    /// Resources taken out of `by_key` (one client's) while their
    /// subscribers keep them: purge, refresh and writes still reach them.
    /// Bounded by `--max-private-resources` (each holds a private slot).
    detached: Vec<std::sync::Weak<Resource>>,
}

impl Variants {
    /// The detached resources still held, forgetting those that are gone.
    fn held_detached(&mut self) -> Vec<Arc<Resource>> {
        let mut held = Vec::new();
        self.detached.retain(|weak| match weak.upgrade() {
            Some(r) if !r.gone.load(Relaxed) => {
                held.push(r);
                true
            }
            _ => false,
        });
        held
    }
}

/// Limits of the registry.
#[derive(Debug, Clone, Copy)]
pub struct RegistryLimits {
    /// Bytes of all tracked states together (`--state-bytes`).
    pub state_bytes: usize,
    /// Resources keyed by credentials or detached (`--max-private-resources`).
    pub max_private: usize,
}

/// The registry of tracked resources: URL → variants.
pub struct Registry {
    urls: Mutex<HashMap<String, Variants>>,
    next_id: std::sync::atomic::AtomicU64,
    private: Arc<std::sync::atomic::AtomicUsize>,
    total: Arc<std::sync::atomic::AtomicUsize>,
    limits: RegistryLimits,
    metrics: Arc<Metrics>,
    /// Bytes held outside the resources' own weights (windows, relayed
    /// windows, copies of answers in flight), counted against the same cap.
    others: Mutex<Vec<HeldElsewhere>>,
    /// Bytes admissions reserved and have not counted yet ([`Reservation`]).
    reserved: Arc<std::sync::atomic::AtomicUsize>,
    /// Held while one admission checks the cap and reserves, so that a
    /// burst of admissions sees each other's reservations.
    admitting: Mutex<()>,
}

/// Bytes an admission (a new subscription's first state) expects to hold,
/// counted against `--state-bytes` from before its first byte is read
/// until the state itself is counted; given back when dropped.
#[must_use = "a reservation counts only while it is held"]
pub struct Reservation {
    bytes: usize,
    reserved: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.bytes, Relaxed);
    }
}

/// Reads the bytes one other holder keeps now.
type HeldElsewhere = Box<dyn Fn() -> usize + Send + Sync>;

impl Registry {
    pub fn new(metrics: Arc<Metrics>, limits: RegistryLimits) -> Registry {
        Registry {
            urls: Mutex::default(),
            next_id: 1.into(),
            private: Arc::default(),
            total: Arc::default(),
            limits,
            metrics,
            others: Mutex::default(),
            reserved: Arc::default(),
            admitting: Mutex::default(),
        }
    }

    /// Reserves `bytes` of `--state-bytes` for a state about to be made
    /// (evicting idle resources to make room), or the refusal (503) when
    /// they do not fit: checked and taken under one lock, so that
    /// admissions arriving together cannot all pass a check made before
    /// any of their bytes are counted.
    pub fn reserve(&self, bytes: usize) -> Result<Reservation, Refusal> {
        let _one = lock(&self.admitting);
        let cap = self.limits.state_bytes;
        if self.state_bytes().saturating_add(bytes) > cap {
            self.evict_idle_until(cap.saturating_sub(bytes));
        }
        if self.state_bytes().saturating_add(bytes) > cap {
            Metrics::inc(&self.metrics.state_refusals_total);
            return Err(state_full(cap));
        }
        self.reserved.fetch_add(bytes, Relaxed);
        Ok(Reservation {
            bytes,
            reserved: self.reserved.clone(),
        })
    }

    /// Whether `key` is tracked now.
    pub fn is_tracked(&self, key: &Key) -> bool {
        lock(&self.urls)
            .get(&key.path)
            .is_some_and(|v| v.by_key.contains_key(&key.secondary))
    }

    /// The key of a request for `path` from `host`, under the `Vary` the
    /// origin last gave for that URL.
    pub fn key_for(&self, path: &str, headers: &HeaderMap, host: &str) -> Key {
        let urls = lock(&self.urls);
        let vary = urls.get(path).map(|v| v.vary.clone()).unwrap_or_default();
        Key {
            path: path.to_string(),
            secondary: rules::secondary_key(headers, host, &vary),
            vary,
        }
    }

    /// Records the `Vary` of an answer for `path`; returns the key the
    /// request with `headers` has under it.
    pub fn learn_vary(&self, path: &str, vary: &Vary, headers: &HeaderMap, host: &str) -> Key {
        self.record_vary(path, vary);
        Key {
            path: path.to_string(),
            secondary: rules::secondary_key(headers, host, vary),
            vary: vary.clone(),
        }
    }

    /// Records that a Braid server answered for `path`.
    pub fn learn_braid(&self, path: &str) {
        lock(&self.urls).entry(path.to_string()).or_default().braid = true;
    }

    /// Records that a plain origin answered for `resource` (and so, as a
    /// hint, for its URL's other variants).
    pub fn learn_plain(&self, resource: &Resource) {
        resource.learn_kind(Kind::Plain);
        if let Some(variants) = lock(&self.urls).get_mut(resource.key()) {
            variants.plain = true;
        }
    }

    /// What `key`'s upstream is, as far as its answers told: its own kind,
    /// else plain when a variant of its URL was answered by a plain origin
    /// (a new variant is then polled at once rather than asked with a
    /// subscription request first). One lock, as a hit takes it.
    pub fn kind_of(&self, key: &Key) -> Kind {
        let urls = lock(&self.urls);
        let Some(variants) = urls.get(&key.path) else {
            return Kind::Unknown;
        };
        let own = variants.by_key.get(&key.secondary).map(|r| {
            r.touch();
            r.kind()
        });
        match own {
            Some(kind) if kind != Kind::Unknown => kind,
            _ if variants.plain => Kind::Plain,
            _ => Kind::Unknown,
        }
    }

    /// Whether a Braid server answered for `path` (while the URL is tracked).
    pub fn is_braid(&self, path: &str) -> bool {
        lock(&self.urls).get(path).is_some_and(|v| v.braid)
    }

    /// Records the `Vary` the origin last answered `path` with.
    pub fn record_vary(&self, path: &str, vary: &Vary) {
        let mut urls = lock(&self.urls);
        let entry = urls.entry(path.to_string()).or_default();
        if entry.vary != *vary {
            entry.vary = vary.clone();
        }
    }

    /// The resource for `key`, and whether it was just created. `with`
    /// runs under the registry lock, so a subscriber it registers cannot
    /// race the idle removal. A new private resource over the cap is a 503.
    pub fn get_or_create<T>(
        &self,
        key: &Key,
        template: impl FnOnce() -> HeaderMap,
        with: impl FnOnce(&Arc<Resource>) -> T,
    ) -> Result<(Arc<Resource>, bool, T), Refusal> {
        if !self.is_tracked(key) {
            self.make_room()?;
        }
        let mut urls = lock(&self.urls);
        let variants = urls.entry(key.path.clone()).or_default();
        if let Some(r) = variants.by_key.get(&key.secondary) {
            r.touch();
            let t = with(r);
            return Ok((r.clone(), false, t));
        }
        let private = key.is_credentialed();
        let slot = match private {
            true => Some(
                self.reserve_private()
                    .ok_or_else(|| private_cap(self.limits.max_private))?,
            ),
            false => None,
        };
        let id = self.next_id.fetch_add(1, Relaxed);
        let r = Arc::new(Resource::new(
            id,
            key.clone(),
            template(),
            private,
            self.total.clone(),
        ));
        lock(&r.placement).slot = slot;
        variants.by_key.insert(key.secondary.clone(), r.clone());
        self.metrics.resources.fetch_add(1, Relaxed);
        let t = with(&r);
        drop(urls);
        self.enforce_cap();
        Ok((r, true, t))
    }

    fn reserve_private(&self) -> Option<PrivateSlot> {
        let max = self.limits.max_private;
        self.private
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()?;
        Some(PrivateSlot {
            count: self.private.clone(),
        })
    }

    /// The resource for `key`, if tracked.
    pub fn get(&self, key: &Key) -> Option<Arc<Resource>> {
        let urls = lock(&self.urls);
        let r = urls.get(&key.path)?.by_key.get(&key.secondary)?.clone();
        r.touch();
        Some(r)
    }

    /// Every tracked resource (for the admin listener's reports).
    pub fn all(&self) -> Vec<Arc<Resource>> {
        lock(&self.urls)
            .values()
            .flat_map(|v| v.by_key.values().cloned())
            .collect()
    }

    /// Every tracked variant of every URL, the detached ones that
    /// subscribers still hold included.
    pub fn every_variant(&self) -> Vec<Arc<Resource>> {
        let mut urls = lock(&self.urls);
        let mut all = Vec::new();
        for variants in urls.values_mut() {
            all.extend(variants.by_key.values().cloned());
            all.extend(variants.held_detached());
        }
        all
    }

    /// Resources tracked as private (credentialed or detached).
    pub fn private_count(&self) -> usize {
        self.private.load(Relaxed)
    }

    /// Every tracked variant of `path`, the detached ones that subscribers
    /// still hold included.
    pub fn variants(&self, path: &str) -> Vec<Arc<Resource>> {
        let mut urls = lock(&self.urls);
        let Some(variants) = urls.get_mut(path) else {
            return Vec::new();
        };
        let mut all: Vec<Arc<Resource>> = variants.by_key.values().cloned().collect();
        all.extend(variants.held_detached());
        all
    }

    /// Takes `resource` out of the registry: no new request finds it; its
    /// current subscribers keep it. Counted as private from then on.
    /// Over the private cap it is dropped instead, and the requests
    /// waiting on it get the cap's 503 ([`Resource::refusal`]).
    pub fn detach(&self, resource: &Arc<Resource>) -> Result<(), Refusal> {
        if resource.is_detached() {
            return Ok(());
        }
        let mut placement = lock(&resource.placement);
        if placement.slot.is_none() {
            match self.reserve_private() {
                Some(taken) => placement.slot = Some(taken),
                None => {
                    let refusal = private_cap(self.limits.max_private);
                    placement.refused = Some(refusal.to_string());
                    drop(placement);
                    self.drop_resource(resource);
                    return Err(refusal);
                }
            }
        }
        drop(placement);
        resource.detached.store(true, Relaxed);
        self.unlink(resource);
        let mut urls = lock(&self.urls);
        let variants = urls.entry(resource.key.clone()).or_default();
        variants.held_detached();
        variants.detached.push(Arc::downgrade(resource));
        Ok(())
    }

    /// Records the `Vary` an answer for `resource` named and moves the
    /// resource to the variant that `Vary` makes of the request that made
    /// it (its template, with `host`): requests of that view find it there.
    /// One lock for both, so that no request sees the new `Vary` without
    /// the resource under it. False (the `Vary` recorded, nothing moved)
    /// when another resource holds that variant or this one is no longer
    /// tracked.
    pub fn rekey(&self, resource: &Arc<Resource>, vary: &Vary, host: &str) -> bool {
        let mut urls = lock(&self.urls);
        let variants = urls.entry(resource.key.clone()).or_default();
        variants.vary = vary.clone();
        let secondary = rules::secondary_key(&resource.template, host, vary);
        let mut placement = lock(&resource.placement);
        let tracked = variants
            .by_key
            .get(&placement.variant.0)
            .is_some_and(|r| Arc::ptr_eq(r, resource));
        if !tracked || variants.by_key.contains_key(&secondary) {
            return false;
        }
        variants.by_key.remove(&placement.variant.0);
        variants.by_key.insert(secondary.clone(), resource.clone());
        placement.variant = (secondary, vary.clone());
        true
    }

    fn unlink(&self, resource: &Arc<Resource>) {
        let mut urls = lock(&self.urls);
        if let Some(variants) = urls.get_mut(&resource.key) {
            let placement = lock(&resource.placement);
            let variant = &placement.variant.0;
            if variants
                .by_key
                .get(variant)
                .is_some_and(|r| Arc::ptr_eq(r, resource))
            {
                variants.by_key.remove(variant);
                self.metrics.resources.fetch_sub(1, Relaxed);
            }
            drop(placement);
            if variants.by_key.is_empty()
                && !variants.braid
                && variants.vary == Vary::None
                && variants.held_detached().is_empty()
            {
                urls.remove(&resource.key);
            }
        }
    }

    /// Marks `resource` as watched, unless it already is; true when the
    /// caller must start its watcher.
    pub fn claim_watcher(&self, resource: &Resource) -> bool {
        let _urls = lock(&self.urls);
        !resource.watching.swap(true, Relaxed)
    }

    /// Called by a watcher about to end because `resource` has had no
    /// subscribers for `idle`. Returns false (keep watching) when a
    /// subscriber came in meanwhile. A shared resource with a stored answer
    /// stays in the registry for plain GETs; others are dropped.
    pub fn watcher_done(&self, resource: &Arc<Resource>, idle: Duration) -> bool {
        {
            let _urls = lock(&self.urls);
            if resource.subscribers() > 0 || resource.idle_for() < idle {
                return false;
            }
            resource.watching.store(false, Relaxed);
        }
        // A private resource gives its slot back when idle: a stored
        // answer only its own client could reuse does not hold one.
        if resource.is_detached() || resource.private || resource.stored().is_none() {
            self.drop_resource(resource);
        }
        true
    }

    /// Forgets a resource (an operator's purge): the next request for its
    /// variant starts afresh at the origin. Its current holders keep it.
    pub fn forget(&self, resource: &Arc<Resource>) {
        self.drop_resource(resource);
    }

    /// Removes a resource for good, releasing its bytes and private slot.
    /// Idempotent: the slot and the weight are taken, so a second call
    /// (eviction racing the watcher's end) gives nothing back twice.
    fn drop_resource(&self, resource: &Arc<Resource>) {
        self.unlink(resource);
        drop(lock(&resource.placement).slot.take());
        // Never counted again, whatever is still recorded into it.
        resource.gone.store(true, Relaxed);
        resource.wake.notify_one();
        let weight = resource.weight.swap(0, Relaxed);
        self.total.fetch_sub(weight, Relaxed);
    }

    /// Drops a resource just made, when the proxy is over `--state-bytes`
    /// once idle resources are evicted: the new state is refused (503).
    pub fn refuse_if_full(&self, resource: &Arc<Resource>) -> Result<(), Refusal> {
        self.make_room()
            .inspect_err(|_| self.drop_resource(resource))
    }

    /// Room for new state (a new resource, a new upstream subscription):
    /// when over `--state-bytes`, evicts idle resources; still over, the
    /// refusal (503) to give.
    pub fn make_room(&self) -> Result<(), Refusal> {
        if !self.is_full() {
            return Ok(());
        }
        self.enforce_cap();
        if !self.is_full() {
            return Ok(());
        }
        Metrics::inc(&self.metrics.state_refusals_total);
        Err(state_full(self.limits.state_bytes))
    }

    /// Bytes held by all tracked states and by the holders registered
    /// with [`Registry::count_also`]: what `--state-bytes` caps.
    pub fn state_bytes(&self) -> usize {
        let others: usize = lock(&self.others).iter().map(|held| held()).sum();
        self.total.load(Relaxed) + others + self.reserved.load(Relaxed)
    }

    /// Whether more than `--state-bytes` is held.
    pub fn is_full(&self) -> bool {
        self.state_bytes() > self.limits.state_bytes
    }

    /// Counts the bytes `held` reads against the cap too.
    pub fn count_also(&self, held: impl Fn() -> usize + Send + Sync + 'static) {
        lock(&self.others).push(Box::new(held));
    }

    /// Evicts the least recently used resources that have neither
    /// subscribers nor a watcher until the total is under the cap (with
    /// some room, so a stream of new URLs does not scan on every request).
    pub fn enforce_cap(&self) {
        let cap = self.limits.state_bytes;
        if self.state_bytes() <= cap {
            return;
        }
        self.evict_idle_until(cap - cap / 8);
    }

    /// Evicts resources nobody uses, least recently used first, until at
    /// most `target` bytes are held (or none is left to evict).
    fn evict_idle_until(&self, target: usize) {
        let mut idle: Vec<(Instant, Arc<Resource>)> = lock(&self.urls)
            .values()
            .flat_map(|v| v.by_key.values())
            .filter(|r| r.subscribers() == 0 && !r.watching.load(Relaxed))
            .map(|r| (*lock(&r.last_used), r.clone()))
            .collect();
        idle.sort_by_key(|(at, _)| *at);
        for (_, r) in idle {
            if self.state_bytes() <= target {
                break;
            }
            self.drop_resource(&r);
            Metrics::inc(&self.metrics.state_evictions_total);
        }
    }

    /// Number of tracked resources.
    pub fn len(&self) -> usize {
        lock(&self.urls).values().map(|v| v.by_key.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn state_full(limit: usize) -> Refusal {
    Refusal::Unavailable {
        reason: format!(
            "the proxy's state is full: resources in use hold its --state-bytes ({limit} bytes); retry later"
        ),
        retry_after: Duration::from_secs(5),
    }
}

fn private_cap(limit: usize) -> Refusal {
    Refusal::Unavailable {
        reason: format!(
            "too many private (credentialed or unshareable) resources tracked (limit {limit}); retry later"
        ),
        retry_after: Duration::from_secs(5),
    }
}
