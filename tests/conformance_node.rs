//! Runs the Node.js conformance suite (`conformance-tests/`) against the
//! freshly built `braid-proxy` binary, using the real `braid-http` 1.3.80
//! client. Requires Node.js >= 20 with npm; runs `npm ci` in
//! `conformance-tests` itself when the packages are missing or stale.

#[path = "common/npm.rs"]
mod npm;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn node_conformance_suite() {
    let dir = npm::ensure_node_packages();
    let bin = env!("CARGO_BIN_EXE_braid-proxy");

    // Own process group, so that on timeout npm, node and every proxy it
    // started can be killed together.
    let mut child = Command::new("npm")
        .arg("test")
        .current_dir(&dir)
        .env("BRAID_PROXY_BIN", bin)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `npm test` in {}: {e} (is Node.js/npm installed?)",
                dir.display()
            )
        });

    let status = npm::wait_or_kill(&mut child, TIMEOUT, "the Node.js conformance suite");
    assert!(
        status.success(),
        "the Node.js conformance suite failed: {status}"
    );
}
