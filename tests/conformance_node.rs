//! Runs the Node.js conformance suite (`conformance-tests/`) against the
//! freshly built `braid-proxy` binary, using the real `braid-http` 1.3.80
//! client. Requires Node.js >= 20 and `npm ci --prefix conformance-tests`.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn node_conformance_suite() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance-tests");
    let bin = env!("CARGO_BIN_EXE_braid-proxy");

    if !dir.join("node_modules").join("braid-http").is_dir() {
        panic!(
            "conformance-tests/node_modules/braid-http is missing: run `npm ci --prefix conformance-tests` \
             (from {}) before `cargo test`",
            env!("CARGO_MANIFEST_DIR")
        );
    }

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

    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() > TIMEOUT => {
                let pgid = format!("-{}", child.id());
                let _ = Command::new("kill").args(["-KILL", "--", &pgid]).status();
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the Node.js conformance suite did not finish within {TIMEOUT:?}; killed it"
                );
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("waiting for `npm test`: {e}"),
        }
    };
    assert!(
        status.success(),
        "the Node.js conformance suite failed: {status}"
    );
}
