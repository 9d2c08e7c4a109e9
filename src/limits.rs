//! Open files: the descriptor limit the process runs with (RLIMIT_NOFILE,
//! raised at start to the hard limit or to `--max-open-files`), and the
//! budget that keeps a reserve of descriptors for the admin listener,
//! upstream connections and plain GETs by refusing new subscriptions
//! before the descriptors run out.
//!
//! Every client connection is one descriptor, so the budget follows them
//! with a counter the accept loop keeps; the other descriptors (listeners,
//! upstream connections, the runtime's own) are counted in
//! `/proc/self/fd` once a second and at every scrape, never per request.

use std::io;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};

/// The soft limit asked for when the hard one is unlimited (as on some
/// BSDs): Linux's default `fs.nr_open`.
const UNLIMITED_HARD: u64 = 1 << 20;

/// The descriptor limit as set at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLimit {
    /// The soft limit the process was started with.
    pub was: u64,
    /// The soft limit it runs with: the most descriptors it may hold.
    pub soft: u64,
    /// The hard limit, the most the soft one may be raised to.
    pub hard: u64,
    /// `--max-open-files` when it asked for more than the hard limit.
    pub capped_from: Option<u64>,
}

/// The descriptor limit could not be read or set.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error("cannot read the open-files limit (RLIMIT_NOFILE): {0}")]
    Read(nix::Error),
    #[error("cannot set the open-files limit (RLIMIT_NOFILE) to {wanted}: {source}")]
    Set { wanted: u64, source: nix::Error },
}

/// Sets the soft descriptor limit to `wanted`, or to the hard limit when
/// `wanted` is 0 or above it. Lowering is allowed (to test the refusals).
pub fn set_open_files(wanted: u64) -> Result<FileLimit, LimitError> {
    let (was, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(LimitError::Read)?;
    let ceiling = if hard == RLIM_INFINITY {
        UNLIMITED_HARD
    } else {
        hard
    };
    let soft = if wanted == 0 {
        ceiling
    } else {
        wanted.min(ceiling)
    };
    if soft != was {
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).map_err(|source| LimitError::Set {
            wanted: soft,
            source,
        })?;
    }
    Ok(FileLimit {
        was,
        soft,
        hard,
        capped_from: (wanted > ceiling).then_some(wanted),
    })
}

/// Sets the descriptor limit at start as `--max-open-files` says
/// (`wanted`, 0 for the hard limit), and warns of what falls short: a
/// limit that cannot be set (the proxy runs with the one it has), a
/// `wanted` above the hard limit, or a limit too low for
/// `max_subscriptions` and the reserve. `None` when it could not be read.
pub fn set_at_start(wanted: u64, max_subscriptions: usize) -> Option<FileLimit> {
    let limit = match set_open_files(wanted) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "running with the open-files limit the proxy was started with");
            let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
            FileLimit {
                was: soft,
                soft,
                hard,
                capped_from: None,
            }
        }
    };
    if let Some(asked) = limit.capped_from {
        tracing::warn!(
            max_open_files = asked,
            hard_limit = limit.hard,
            "--max-open-files is above the hard limit; using the hard limit (raise it with LimitNOFILE=, ulimit -Hn or docker run --ulimit nofile=)"
        );
    }
    let needed = (max_subscriptions as u64).saturating_add(reserve_of(limit.soft));
    if needed > limit.soft {
        tracing::warn!(
            open_files = limit.soft,
            max_subscriptions,
            reserve = reserve_of(limit.soft),
            "the open-files limit is below --max-subscriptions plus the reserve: new subscriptions will be refused (503) once about {} files are open (each client connection is one); raise the hard limit (LimitNOFILE=, ulimit -Hn, docker run --ulimit nofile=) or lower --max-subscriptions",
            limit.soft.saturating_sub(reserve_of(limit.soft)),
        );
    }
    Some(limit)
}

impl std::fmt::Display for FileLimit {
    /// `65536 (raised from 1024; hard limit 65536)`, as the banner says it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match self.soft.cmp(&self.was) {
            std::cmp::Ordering::Greater => "raised from ",
            std::cmp::Ordering::Less => "lowered from ",
            std::cmp::Ordering::Equal => {
                return write!(f, "{} (hard limit {})", self.soft, self.hard)
            }
        };
        write!(
            f,
            "{} ({how}{}; hard limit {})",
            self.soft, self.was, self.hard
        )
    }
}

/// The soft descriptor limit in effect now.
pub fn current_limit() -> Result<u64, LimitError> {
    getrlimit(Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .map_err(LimitError::Read)
}

/// Descriptors kept free of subscriptions out of `limit`: a sixteenth, at
/// least 64 (the admin listener, upstream connections, plain GETs).
pub fn reserve_of(limit: u64) -> u64 {
    (limit / 16).max(64)
}

/// Counts the process's open descriptors now (`/proc/self/fd` on Linux,
/// `/dev/fd` elsewhere); `None` where neither can be listed. The cost
/// grows with the count: called once a second and per scrape only.
pub fn count_open_fds() -> Option<u64> {
    for dir in ["/proc/self/fd", "/dev/fd"] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            // The listing's own descriptor is among the entries.
            let n = entries.count() as u64;
            return Some(n.saturating_sub(1));
        }
    }
    None
}

/// The descriptor budget of one proxy: the limit, its reserve, and an
/// estimate of the descriptors open that is cheap enough to read for
/// every subscription.
#[derive(Debug)]
pub struct OpenFiles {
    limit: u64,
    reserve: u64,
    /// Client connections open now, counted by the accept loop.
    connections: AtomicI64,
    /// Descriptors other than client connections at the last count.
    others: AtomicI64,
}

/// Descriptors assumed besides client connections where they cannot be
/// counted: stdio, the listeners, the runtime's poller.
const UNCOUNTED_OTHERS: i64 = 16;

impl OpenFiles {
    /// The budget for `limit` descriptors, counting the ones open now.
    pub fn new(limit: u64) -> OpenFiles {
        let files = OpenFiles {
            limit,
            reserve: reserve_of(limit),
            connections: AtomicI64::new(0),
            others: AtomicI64::new(UNCOUNTED_OTHERS),
        };
        files.count();
        files
    }

    /// The budget for the limit in effect now (unlimited if it cannot be read).
    pub fn for_this_process() -> OpenFiles {
        OpenFiles::new(current_limit().unwrap_or(u64::MAX))
    }

    /// The most descriptors the process may hold.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Descriptors kept free of new subscriptions.
    pub fn reserve(&self) -> u64 {
        self.reserve
    }

    /// Counts one client connection for as long as the guard lives.
    pub fn connection(self: &Arc<Self>) -> ClientConnection {
        self.connections.fetch_add(1, Relaxed);
        ClientConnection(self.clone())
    }

    /// Descriptors open, as estimated: the others at the last count plus
    /// the client connections open now.
    pub fn estimate(&self) -> u64 {
        let n = self.others.load(Relaxed) + self.connections.load(Relaxed);
        n.max(0) as u64
    }

    /// Counts the descriptors open now and bases the estimate on it; the
    /// estimate where they cannot be counted.
    pub fn count(&self) -> u64 {
        let Some(open) = count_open_fds() else {
            return self.estimate();
        };
        let connections = self.connections.load(Relaxed);
        self.others.store(open as i64 - connections, Relaxed);
        open
    }

    /// Whether a new subscription leaves the reserve free.
    pub fn admits_subscription(&self) -> bool {
        self.estimate().saturating_add(self.reserve) < self.limit
    }

    /// How far the descriptors open reach into the reserve: how many would
    /// have to close for a new subscription to be admitted (0 when one is).
    /// Idle client connections are closed for them (src/listen/idle.rs).
    pub fn into_reserve(&self) -> u64 {
        (self.estimate().saturating_add(self.reserve) + 1).saturating_sub(self.limit)
    }

    /// Whether a new client connection may be served: not within the last
    /// quarter of the reserve, which is left to the admin listener and
    /// upstream connections. Beyond it a new client connection is closed
    /// at once; idle ones are closed well before (from the reserve's start).
    pub fn admits_connection(&self) -> bool {
        self.estimate().saturating_add(self.reserve / 4) < self.limit
    }

    /// Counts the descriptors every `every` until `closing` turns true, so
    /// that upstream connections and the like reach the estimate. A count
    /// costs about 0.6 µs per descriptor (12 ms at 19,000, measured): the
    /// pause after one is at least a hundred times what it took, so that
    /// counting keeps under 1% of a core however many there are.
    pub async fn count_every(
        self: Arc<Self>,
        every: Duration,
        mut closing: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut pause = every;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = closing.wait_for(|closing| *closing) => return,
            }
            // Off the runtime's workers: at tens of thousands of
            // descriptors a count takes milliseconds.
            let files = self.clone();
            let took = tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                files.count();
                started.elapsed()
            })
            .await
            .unwrap_or(every);
            pause = every.max(took * 100);
        }
    }
}

/// One client connection counted in [`OpenFiles`]; uncounted on drop.
pub struct ClientConnection(Arc<OpenFiles>);

impl Drop for ClientConnection {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Relaxed);
    }
}

/// What an accept loop does after a failed `accept`: it waits (longer
/// while the failures go on, up to [`AcceptErrors::MAX_PAUSE`]) instead
/// of trying again at once, and logs at most one line a second, saying
/// how many failures it did not log.
#[derive(Debug)]
pub struct AcceptErrors {
    /// Which listener, for the log line.
    listener: &'static str,
    pause: Duration,
    logged: Option<Instant>,
    unlogged: u64,
}

impl AcceptErrors {
    /// The first pause after a failure.
    pub const MIN_PAUSE: Duration = Duration::from_millis(10);
    /// The longest pause.
    pub const MAX_PAUSE: Duration = Duration::from_millis(500);
    /// The least time between two log lines.
    pub const LOG_EVERY: Duration = Duration::from_secs(1);

    pub fn new(listener: &'static str) -> AcceptErrors {
        AcceptErrors {
            listener,
            pause: Self::MIN_PAUSE,
            logged: None,
            unlogged: 0,
        }
    }

    /// An accept succeeded: the next failure pauses briefly again.
    pub fn accepted(&mut self) {
        self.pause = Self::MIN_PAUSE;
    }

    /// An accept failed: logs it (or counts it when a line was logged in
    /// the last second) and returns how long to wait before the next.
    pub fn failed(&mut self, error: &io::Error) -> Duration {
        let now = Instant::now();
        if self.logged.is_none_or(|at| now - at >= Self::LOG_EVERY) {
            let out_of_files = is_out_of_files(error);
            tracing::warn!(
                listener = self.listener,
                %error,
                out_of_files,
                more = self.unlogged,
                "accept failed; pausing before the next (more: failures since the last line)"
            );
            self.logged = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        let pause = self.pause;
        self.pause = (self.pause * 2).min(Self::MAX_PAUSE);
        pause
    }
}

/// Whether `error` says the process (EMFILE) or the system (ENFILE) is
/// out of descriptors.
pub fn is_out_of_files(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(code) if code == nix::errno::Errno::EMFILE as i32 || code == nix::errno::Errno::ENFILE as i32
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_sixteenth_and_at_least_64() {
        assert_eq!(reserve_of(256), 64);
        assert_eq!(reserve_of(1024), 64);
        assert_eq!(reserve_of(65_536), 4096);
    }

    #[test]
    fn client_connections_count_until_dropped() {
        let files = Arc::new(OpenFiles::new(1000));
        let base = files.estimate();
        let held: Vec<_> = (0..10).map(|_| files.connection()).collect();
        assert_eq!(files.estimate(), base + 10);
        drop(held);
        assert_eq!(files.estimate(), base);
    }

    #[test]
    fn subscriptions_are_refused_within_the_reserve() {
        let files = Arc::new(OpenFiles::new(4096));
        let base = files.estimate();
        assert!(base < 4096 - 256, "{base} descriptors open in the test");
        let mut held = Vec::new();
        while files.admits_subscription() {
            held.push(files.connection());
        }
        assert_eq!(files.estimate(), 4096 - 256);
        held.pop();
        assert!(files.admits_subscription());
    }

    #[test]
    fn the_reserve_is_entered_before_connections_are_refused() {
        let files = Arc::new(OpenFiles::new(4096));
        let mut held = Vec::new();
        while files.admits_subscription() {
            assert_eq!(files.into_reserve(), 0);
            held.push(files.connection());
        }
        assert_eq!(files.into_reserve(), 1);
        // A quarter of the reserve (256) is kept from client connections.
        while files.admits_connection() {
            held.push(files.connection());
        }
        assert_eq!(files.estimate(), 4096 - 64);
        assert_eq!(files.into_reserve(), 256 - 64 + 1);
    }

    #[test]
    fn accept_errors_pause_longer_and_log_once_a_second() {
        let mut errors = AcceptErrors::new("test");
        let emfile = io::Error::from_raw_os_error(nix::errno::Errno::EMFILE as i32);
        assert!(is_out_of_files(&emfile));
        let pauses: Vec<_> = (0..8).map(|_| errors.failed(&emfile)).collect();
        assert_eq!(pauses[0], AcceptErrors::MIN_PAUSE);
        assert!(pauses.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(pauses[7], AcceptErrors::MAX_PAUSE);
        assert_eq!(errors.unlogged, 7);
        errors.accepted();
        assert_eq!(errors.failed(&emfile), AcceptErrors::MIN_PAUSE);
    }
}
