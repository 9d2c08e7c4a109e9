//! Shared by the tests that run Node.js (`conformance_node.rs`,
//! `cache_tests.rs`): makes sure `node` and `npm` are there and that
//! `conformance-tests/node_modules` matches `package-lock.json`, running
//! `npm ci` if not. Included with `#[path = "common/npm.rs"] mod npm;`.
//!
//! Installs are serialized across processes with a lock directory,
//! `target/npm-install.lock` (`mkdir` is atomic; `target/` is ignored by git
//! and survives `npm ci`, unlike anything in `node_modules`). It holds the
//! owner's pid; a lock whose owner is gone (a killed test) is taken over.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// The packages the tests import; a missing one means "install".
const REQUIRED_PACKAGES: &[&str] = &["braid-http", "http-cache-tests", "playwright-core"];
const MIN_NODE_MAJOR: u32 = 20;
const NPM_CI_TIMEOUT: Duration = Duration::from_secs(600);
/// How long to wait for another process's install before giving up.
const LOCK_WAIT: Duration = Duration::from_secs(660);
const INSTALL_HINT: &str = "install Node.js >= 20 with npm (e.g. from https://nodejs.org, \
                            or `apt-get install nodejs npm` where the distribution ships >= 20)";

/// In-process guard: the lock directory only tells processes apart.
static IN_PROCESS: Mutex<()> = Mutex::new(());

/// The `conformance-tests` directory of this checkout.
pub fn conformance_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance-tests")
}

/// Panics with what to install unless `node` (>= 20) and `npm` run; then
/// runs `npm ci --no-audit --no-fund` in `conformance-tests` when the
/// packages are missing or older than `package-lock.json`, one process at a time.
pub fn ensure_node_packages() -> PathBuf {
    let dir = conformance_dir();
    check_node();
    check_npm();

    let _guard = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let _lock = InstallLock::acquire();

    // Checked under the lock: another test binary may be installing right now.
    if let Some(reason) = install_reason(&dir) {
        eprintln!("conformance-tests: {reason}; running `npm ci --no-audit --no-fund`");
        run_npm_ci(&dir);
        if let Some(reason) = install_reason(&dir) {
            panic!("`npm ci` in {} finished, but {reason}", dir.display());
        }
    }
    // `_lock` is removed on return (or when a panic unwinds).
    dir
}

/// The cross-process lock directory; removed on drop.
struct InstallLock {
    path: PathBuf,
}

impl InstallLock {
    fn acquire() -> InstallLock {
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        let _ = std::fs::create_dir_all(&target);
        let path = target.join("npm-install.lock");
        let me = std::process::id().to_string();
        let start = Instant::now();
        loop {
            match std::fs::create_dir(&path) {
                Ok(()) => {
                    std::fs::write(path.join("pid"), &me).unwrap_or_else(|e| {
                        panic!("cannot write {}: {e}", path.join("pid").display())
                    });
                    return InstallLock { path };
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => panic!("cannot create {}: {e}", path.display()),
            }
            // Held by someone: take it over if its owner has died. No pid
            // means it is being created; after 10 s, that its creator died.
            let orphan = !path.join("pid").exists()
                && mtime(&path)
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > Duration::from_secs(10));
            if orphan {
                let _ = std::fs::remove_dir_all(&path);
                continue;
            }
            if let Ok(owner) = std::fs::read_to_string(path.join("pid")) {
                let owner = owner.trim();
                let alive = !owner.is_empty() && Path::new("/proc").join(owner).exists();
                let unchanged = std::fs::read_to_string(path.join("pid"))
                    .map(|again| again.trim() == owner)
                    .unwrap_or(false);
                if !alive && unchanged {
                    eprintln!(
                        "conformance-tests: removing stale {} of pid {owner}",
                        path.display()
                    );
                    let _ = std::fs::remove_dir_all(&path);
                    continue;
                }
            }
            assert!(
                start.elapsed() < LOCK_WAIT,
                "waited {LOCK_WAIT:?} for {} (another `npm ci`); remove it if no test is running",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for InstallLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn check_node() {
    let out = Command::new("node")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run `node` ({e}): {INSTALL_HINT}"));
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let major = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok());
    match major {
        Some(m) if out.status.success() && m >= MIN_NODE_MAJOR => {}
        _ => panic!("`node --version` says {version:?}: {INSTALL_HINT}"),
    }
}

fn check_npm() {
    let ok = Command::new("npm")
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "cannot run `npm --version`: {INSTALL_HINT}");
}

/// Why `npm ci` is needed, or `None` if `node_modules` is up to date.
fn install_reason(dir: &Path) -> Option<String> {
    let modules = dir.join("node_modules");
    for package in REQUIRED_PACKAGES {
        if !modules.join(package).join("package.json").is_file() {
            return Some(format!("node_modules/{package} is missing"));
        }
    }
    let hidden = modules.join(".package-lock.json");
    let Some(installed) = mtime(&hidden) else {
        return Some("node_modules/.package-lock.json is missing".into());
    };
    match mtime(&dir.join("package-lock.json")) {
        Some(lock) if lock > installed => {
            Some("package-lock.json is newer than node_modules/.package-lock.json".into())
        }
        _ => None,
    }
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn run_npm_ci(dir: &Path) {
    use std::os::unix::process::CommandExt;
    // stdout goes to stderr so the test's own output stays readable.
    let mut child = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `npm ci` in {}: {e}: {INSTALL_HINT}",
                dir.display()
            )
        });
    let status = wait_or_kill(&mut child, NPM_CI_TIMEOUT, "`npm ci`");
    assert!(
        status.success(),
        "`npm ci --no-audit --no-fund` in {} failed: {status} (the npm registry must be reachable)",
        dir.display()
    );
}

/// Waits for `child` (started in its own process group) for at most
/// `timeout`; on timeout kills the whole group and panics naming `what`.
pub fn wait_or_kill(
    child: &mut std::process::Child,
    timeout: Duration,
    what: &str,
) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) if start.elapsed() > timeout => {
                let pgid = format!("-{}", child.id());
                let _ = Command::new("kill").args(["-KILL", "--", &pgid]).status();
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what} did not finish within {timeout:?}; killed it");
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("waiting for {what}: {e}"),
        }
    }
}
