//! Runs mnot's HTTP caching test suite (npm `http-cache-tests` 0.4.5, the
//! 350 tests of <https://cache-tests.fyi>, RFC 9111) through the freshly
//! built `braid-proxy` binary: `conformance-tests/cache-tests/run.mjs`
//! starts the suite's origin server and the proxy on loopback, runs every
//! test and fails if fewer than `CACHE_TESTS_FLOOR` pass. Requires Node.js
//! 20 or later with npm; runs `npm ci` in `conformance-tests` when needed.
//! The results JSON and the output go to `CARGO_TARGET_TMPDIR`
//! (`cache-tests-results.json`, `cache-tests-results.log`); the output is
//! also printed through the test harness (`cargo test --test cache_tests --
//! --nocapture` shows the summary even when the test passes).

#[path = "common/npm.rs"]
mod npm;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Tests of the suite (out of 350) that must pass through the proxy.
/// run.mjs first has the proxy serve a Braid server's resource (a 209 and
/// two GETs, the second a hit), so the suite runs on a proxy that has seen
/// Braid headers: 294 of 350 on 2026-12-06 (115 before kinds were learned
/// per resource), then 293 once a 304 naming another ETag stopped
/// freshening the stored answer (RFC 9111 §4.3.4); 303 (157 required) on
/// 2026-12-06 in three runs of the release build once issue 39 answered
/// ranges from state, served stale under stale-if-error and let a HEAD's
/// 200 freshen the stored answer. Measured 2026-12-03: 292 of 350 (157 of the 165 required), the same in
/// three runs; commit 0a17993 passed 0, nginx with no cache passes 114, the
/// best shared cache measured here (ATS with heuristics) 259. The floor
/// sits two below the measurement for the few tests that hinge on the
/// suite's 3-second pauses; raise it as caching improves, never lower it.
const CACHE_TESTS_FLOOR: u32 = 301;

/// run.mjs stops itself after 240 s; this is the backstop.
const TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn http_cache_tests_suite() {
    let dir = npm::ensure_node_packages();
    let results =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cache-tests-results.json");

    // The summary lists every failing test: it goes to a log file, printed
    // through the test harness (shown on failure or with --nocapture).
    let log_path = results.with_extension("log");
    let out = std::fs::File::create(&log_path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", log_path.display()));
    let err = out.try_clone().expect("clone log file");

    // Own process group: on timeout node, the origin and the proxy go together.
    let mut child = Command::new("node")
        .arg("cache-tests/run.mjs")
        .current_dir(&dir)
        .env("BRAID_PROXY_BIN", env!("CARGO_BIN_EXE_braid-proxy"))
        .env("CACHE_TESTS_FLOOR", CACHE_TESTS_FLOOR.to_string())
        .env("CACHE_TESTS_RESULTS", &results)
        .env("CACHE_TESTS_TIMEOUT", "240")
        .env_remove("CACHE_TESTS_BASE")
        .env_remove("CACHE_TESTS_ID")
        .env_remove("CACHE_TESTS_ORIGIN_PORT")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `node cache-tests/run.mjs` in {}: {e}",
                dir.display()
            )
        });

    let status = npm::wait_or_kill(
        &mut child,
        TIMEOUT,
        &format!("the cache-tests suite (output in {})", log_path.display()),
    );
    print!("{}", std::fs::read_to_string(&log_path).unwrap_or_default());
    assert!(
        status.success(),
        "the cache-tests suite failed ({status}): fewer than CACHE_TESTS_FLOOR = {CACHE_TESTS_FLOOR} \
         tests passed, or the run could not start (see the output above; results in {})",
        results.display()
    );
}
