//! How often the watchers ask a plain origin: each resource's own
//! interval ([`Cadence`]), short while it changes and longer while it is
//! quiet, and one budget for the origin ([`Budget`]): at most
//! `--origin-rps` requests a second from all watchers together, the
//! slots going first to resources that change or were just asked about,
//! and a pause for all of them when the origin says `Retry-After`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::floor::sync::lock;

/// Longest pause an origin's `Retry-After` imposes on the watchers; a
/// longer one is read as this (a typo in a header should not stop change
/// detection for a day).
pub const MAX_ORIGIN_PAUSE: Duration = Duration::from_secs(600);

/// One resource's polling interval: `min` (`--poll-interval`) after a
/// change, a write, a refresh or a new subscriber, doubling with each
/// quiet poll up to `max` (`--poll-max-interval`). A change is then seen
/// within `max` (plus the spread), and a resource that never changes costs
/// the origin one request per `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cadence {
    min: Duration,
    max: Duration,
    current: Duration,
    /// The interval changed since the last wait was taken: the next one is
    /// spread wide ([`Cadence::wait`]).
    moved: bool,
}

impl Cadence {
    pub fn new(min: Duration, max: Duration) -> Cadence {
        Cadence {
            min,
            max: max.max(min),
            current: min,
            moved: true,
        }
    }

    /// Back to the shortest interval: something changed or is expected to.
    pub fn reset(&mut self) {
        self.moved |= self.current != self.min;
        self.current = self.min;
    }

    /// A poll found nothing new: wait longer next time.
    pub fn quiet(&mut self) {
        let next = self.current.saturating_mul(2).min(self.max);
        self.moved |= next != self.current;
        self.current = next;
    }

    /// The wait before the next poll: the interval, spread ([`spread`])
    /// by a tenth either way, or, the first time at a new interval, drawn
    /// from 0.4 to 1.1 of it, so that resources whose intervals grew in
    /// step (subscribed together, all quiet) come apart across the
    /// interval instead of polling in waves; never more than 1.1 times it.
    pub fn wait(&mut self, seed: u64, turn: u64) -> Duration {
        let wide = std::mem::take(&mut self.moved);
        let (low, high) = if wide { (0.4, 1.1) } else { (0.9, 1.1) };
        spread(self.current, seed, turn, (low, high))
    }

    /// The interval before the next poll (before [`spread`]).
    pub fn current(&self) -> Duration {
        self.current
    }

    /// Whether the resource changed lately (its interval is still the
    /// shortest, or one step above): its polls take a budget's slots first.
    pub fn lively(&self) -> bool {
        self.current <= self.min.saturating_mul(2)
    }
}

/// `interval` times a fraction drawn from `range` (low, high),
/// differently for each `seed` and `turn`, so that resources subscribed
/// at the same moment do not poll in step (a burst at the origin every
/// interval).
pub fn spread(interval: Duration, seed: u64, turn: u64, range: (f64, f64)) -> Duration {
    // splitmix64: well-mixed bits from a counter, no state to share.
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(turn.wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let (low, high) = range;
    let fraction = low + (high - low) * ((z >> 11) as f64 / (1u64 << 53) as f64);
    interval.mul_f64(fraction)
}

/// The origin's budget, shared by every watcher: requests are given
/// slots at least `1 / --origin-rps` apart (so they are spread evenly,
/// never a burst), and none while the origin's `Retry-After` lasts.
pub struct Budget {
    /// Time between two slots; `None`: no budget (`--origin-rps` unset).
    gap: Option<Duration>,
    /// One lock: each request takes the next slot and moves it on, and
    /// reads the pause; held for a few instructions, never across a wait.
    slots: Mutex<Slots>,
    /// Requests that waited for a slot (the requests sent are counted in
    /// `Metrics::polls_total`).
    delayed: AtomicU64,
}

struct Slots {
    /// The earliest time the next request may go.
    next: Instant,
    /// Until when the origin asked for no requests (`Retry-After`).
    paused_until: Option<Instant>,
}

/// What [`Budget::take`] decided for one request.
enum Turn {
    /// Go now.
    Go,
    /// A slot is taken at this time: wait for it, then go.
    At(Instant),
    /// No slot given (paused, or a backlog that livelier resources use
    /// first): ask again then.
    Retry(Instant),
}

impl Budget {
    /// A budget of `rps` requests a second (`None`: unlimited).
    pub fn new(rps: Option<f64>) -> Budget {
        Budget {
            gap: rps
                .filter(|r| *r > 0.0 && r.is_finite())
                .map(|r| Duration::from_secs_f64(1.0 / r)),
            slots: Mutex::new(Slots {
                next: Instant::now(),
                paused_until: None,
            }),
            delayed: AtomicU64::new(0),
        }
    }

    /// Waits until one watcher request may go. `urgent` (a resource that
    /// changes, a new subscriber waiting, a refresh) takes the next slot
    /// whatever the backlog; others only a slot free within one gap, so
    /// that under a full budget the lively resources are asked first.
    /// `offset`: how long after an origin's pause ends this one goes (its
    /// own place within its interval, so the watchers do not all ask at
    /// the moment the pause ends).
    pub async fn admit(&self, urgent: bool, offset: Duration) {
        let mut waited = false;
        loop {
            match self.take(urgent, offset, Instant::now()) {
                Turn::Go => break,
                Turn::At(at) => {
                    waited = true;
                    tokio::time::sleep_until(at.into()).await;
                    break;
                }
                Turn::Retry(at) => {
                    waited = true;
                    tokio::time::sleep_until(at.into()).await;
                }
            }
        }
        if waited {
            self.delayed.fetch_add(1, Relaxed);
        }
    }

    fn take(&self, urgent: bool, offset: Duration, now: Instant) -> Turn {
        let mut slots = lock(&self.slots);
        if let Some(until) = slots.paused_until {
            if until > now {
                return Turn::Retry(until + offset);
            }
            slots.paused_until = None;
        }
        let Some(gap) = self.gap else {
            return Turn::Go;
        };
        let slot = slots.next.max(now);
        if !urgent && slot > now + gap {
            // A backlog: the lively ones take these slots first.
            return Turn::Retry(slot);
        }
        slots.next = slot + gap;
        if slot <= now {
            Turn::Go
        } else {
            Turn::At(slot)
        }
    }

    /// The origin asked for no requests for `wait` (a 429 or 503 with
    /// `Retry-After`): no watcher asks it before then (at most
    /// [`MAX_ORIGIN_PAUSE`]).
    pub fn pause(&self, wait: Duration) {
        let until = Instant::now() + wait.min(MAX_ORIGIN_PAUSE);
        let mut slots = lock(&self.slots);
        slots.paused_until = Some(slots.paused_until.map_or(until, |p| p.max(until)));
        slots.next = slots.next.max(until);
    }

    /// Until when the origin's `Retry-After` holds the watchers, if it does.
    pub fn paused_for(&self) -> Option<Duration> {
        let until = lock(&self.slots).paused_until?;
        until.checked_duration_since(Instant::now())
    }

    /// Requests that waited for a slot or for the origin's pause.
    pub fn delayed(&self) -> u64 {
        self.delayed.load(Relaxed)
    }
}

/// The wait an origin's `Retry-After` asks for: delay-seconds or an HTTP
/// date (RFC 9110 §10.2.3); `None` when absent or unreadable.
pub fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = crate::floor::rules::parse_date(value)?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cadence_doubles_while_quiet_and_resets_on_change() {
        let s = Duration::from_secs;
        let mut c = Cadence::new(s(1), s(10));
        assert_eq!(c.current(), s(1));
        let mut seen = Vec::new();
        for _ in 0..6 {
            c.quiet();
            seen.push(c.current().as_secs());
        }
        assert_eq!(seen, [2, 4, 8, 10, 10, 10]);
        assert!(!c.lively());
        c.reset();
        assert_eq!(c.current(), s(1));
        assert!(c.lively());
        // A maximum below the minimum is today's fixed interval.
        let mut fixed = Cadence::new(s(1), s(1));
        fixed.quiet();
        assert_eq!(fixed.current(), s(1));
    }

    #[test]
    fn spread_stays_within_a_tenth_and_differs() {
        let base = Duration::from_secs(10);
        let mut distinct = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let d = spread(base, seed, 3, (0.9, 1.1));
            assert!(
                d >= Duration::from_secs(9) && d < Duration::from_secs(11),
                "{d:?}"
            );
            distinct.insert(d.as_millis());
        }
        assert!(distinct.len() > 150, "{} distinct of 200", distinct.len());
    }

    #[test]
    fn the_first_wait_at_a_new_interval_is_spread_wide() {
        let s = Duration::from_secs;
        let mut c = Cadence::new(s(1), s(10));
        for _ in 0..4 {
            c.quiet();
        }
        assert_eq!(c.current(), s(10));
        // Across resources, the first wait at 10 s covers 4 to 11 s.
        let firsts: Vec<Duration> = (0..500)
            .map(|seed| {
                let mut one = c;
                one.wait(seed, 0)
            })
            .collect();
        assert!(firsts.iter().all(|d| *d >= s(4) && *d <= s(11)));
        assert!(firsts.iter().any(|d| *d < s(6)) && firsts.iter().any(|d| *d > s(10)));
        // Then at most a tenth either way, until the interval moves again.
        let _ = c.wait(1, 0);
        for turn in 1..50 {
            let d = c.wait(1, turn);
            assert!(d >= s(9) && d <= s(11), "{d:?}");
        }
        c.quiet(); // at the ceiling: no move
        assert!(c.wait(1, 99) >= s(9));
        c.reset();
        assert!(c.wait(1, 100) <= Duration::from_millis(1100));
    }

    #[test]
    fn budget_slots_are_a_gap_apart_and_urgent_ones_go_first() {
        let budget = Budget::new(Some(10.0));
        let now = Instant::now();
        let gap = Duration::from_millis(100);
        assert!(matches!(budget.take(true, Duration::ZERO, now), Turn::Go));
        let Turn::At(second) = budget.take(true, Duration::ZERO, now) else {
            panic!("the second request in the same instant waits a gap");
        };
        assert!(second >= now + gap);
        let Turn::At(third) = budget.take(true, Duration::ZERO, now) else {
            panic!("an urgent one takes a slot whatever the backlog");
        };
        assert!(third >= second + gap);
        // A quiet one does not join a backlog of more than a gap.
        assert!(matches!(
            budget.take(false, Duration::ZERO, now),
            Turn::Retry(_)
        ));
        // Unlimited: always at once.
        let free = Budget::new(None);
        for _ in 0..1000 {
            assert!(matches!(free.take(false, Duration::ZERO, now), Turn::Go));
        }
    }

    #[test]
    fn a_pause_holds_every_request() {
        let budget = Budget::new(None);
        budget.pause(Duration::from_secs(5));
        let now = Instant::now();
        let offset = Duration::from_millis(300);
        let Turn::Retry(at) = budget.take(true, offset, now) else {
            panic!("paused");
        };
        assert!(at >= now + Duration::from_secs(4) + offset);
        assert!(budget.paused_for().is_some());
        // Past the pause, requests go again.
        let later = now + Duration::from_secs(6);
        assert!(matches!(budget.take(false, offset, later), Turn::Go));
        // Retry-After is bounded.
        budget.pause(Duration::from_secs(86_400));
        assert!(budget.paused_for().is_some_and(|d| d <= MAX_ORIGIN_PAUSE));
    }

    #[test]
    fn retry_after_in_seconds_or_a_date() {
        let mut h = http::HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(http::header::RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        let soon = std::time::SystemTime::now() + Duration::from_secs(30);
        h.insert(
            http::header::RETRY_AFTER,
            httpdate::fmt_http_date(soon).parse().unwrap(),
        );
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(25) && d <= Duration::from_secs(30),
            "{d:?}"
        );
        h.insert(http::header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&h), None);
    }
}
