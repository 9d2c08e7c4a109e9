//! What an operator relies on, over real sockets on 127.0.0.1:0: `/readyz`
//! follows the upstream, the admin token guards `/metrics` and `/refresh`,
//! a non-loopback admin listener needs a token, `--log-format json` writes
//! one JSON object per line, and `--workers 1` serves on one thread.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use braid_proxy::config::{Args, Config, Upstream};
use braid_proxy::listen::server::Server;
use bytes::Bytes;
use clap::Parser;
use http::Response;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(10);
const TOKEN: &str = "an-operators-token-0123";

async fn call(addr: SocketAddr, path: &str, extra: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n{extra}\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut out))
        .await
        .expect("answer in time")
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

/// Starts a proxy for `upstream` with an admin listener; returns (client, admin).
async fn start(upstream: SocketAddr, tune: impl FnOnce(&mut Config)) -> (SocketAddr, SocketAddr) {
    let mut config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        upstream: Some(Upstream::parse(&format!("http://{upstream}")).expect("upstream")),
        poll_interval: Duration::from_millis(100),
        connect_timeout: Duration::from_millis(300),
        ..Config::default()
    };
    tune(&mut config);
    let server = Server::bind(config).await.expect("bind");
    let addrs = (
        server.local_addr().expect("addr"),
        server.admin_addr().expect("admin"),
    );
    tokio::spawn(server.run(std::future::pending()));
    addrs
}

/// Polls `/readyz` until its status line starts with `want` (bounded).
async fn readyz_until(admin: SocketAddr, want: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let answer = call(admin, "/readyz", "").await;
        if answer.starts_with(want) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "readyz never gave {want}; last:\n{answer}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plain origin answering "up" on `addr`, until the task is aborted;
/// its connections end with it (a JoinSet aborts them when dropped).
async fn serve_on(addr: SocketAddr) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.expect("rebind");
    tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((stream, _)) = listener.accept().await {
            connections.spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("up"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_upstream() {
    // An origin we can stop and start again on the same port.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let origin_addr = listener.local_addr().expect("addr");
    drop(listener);
    let origin = serve_on(origin_addr).await;
    let (client, admin) = start(origin_addr, |_| {}).await;
    readyz_until(admin, "HTTP/1.1 200").await;
    // A live subscription, then the origin goes away.
    let mut sub = TcpStream::connect(client).await.expect("connect");
    sub.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
        .await
        .expect("write");
    origin.abort();
    let _ = origin.await;
    let started = Instant::now();
    let down = readyz_until(admin, "HTTP/1.1 503").await;
    assert!(down.contains("not ready: "), "{down}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "not ready within a few poll intervals: {:?}",
        started.elapsed()
    );
    assert!(
        call(admin, "/healthz", "")
            .await
            .starts_with("HTTP/1.1 200"),
        "liveness stays up"
    );
    // The origin comes back: ready again.
    let _back = serve_on(origin_addr).await;
    readyz_until(admin, "HTTP/1.1 200").await;
}

#[tokio::test]
async fn the_admin_token_guards_metrics_and_refresh() {
    let origin = common::serve(|_| Response::new(Full::new(Bytes::from("x")))).await;
    let (_, admin) = start(origin, |c| c.admin_token = Some(TOKEN.into())).await;
    let denied = call(admin, "/metrics", "").await;
    assert!(denied.starts_with("HTTP/1.1 401"), "{denied}");
    assert!(
        denied.to_lowercase().contains("www-authenticate: bearer"),
        "{denied}"
    );
    let wrong = call(
        admin,
        "/metrics",
        "Authorization: Bearer not-the-token-at-all\r\n",
    )
    .await;
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let ok = call(
        admin,
        "/metrics",
        &format!("Authorization: Bearer {TOKEN}\r\n"),
    )
    .await;
    assert!(
        ok.starts_with("HTTP/1.1 200") && ok.contains("braid_proxy_requests_total"),
        "{ok}"
    );
    for metric in [
        "braid_proxy_resources_private",
        "braid_proxy_bytes_sent_total",
        "braid_proxy_upstream_connect_errors_total",
        "braid_proxy_upstream_response_seconds_bucket",
        "braid_proxy_validation_age_seconds_bucket",
        "braid_proxy_cache_hits_total",
        "braid_proxy_history_evictions_total",
    ] {
        assert!(ok.contains(metric), "{metric} missing");
    }
    // The operator's page and its data follow the same rule.
    let bearer = format!("Authorization: Bearer {TOKEN}\r\n");
    for path in ["/", "/status"] {
        let denied = call(admin, path, "").await;
        assert!(denied.starts_with("HTTP/1.1 401"), "{path}: {denied}");
        let ok = call(admin, path, &bearer).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{path}: {ok}");
    }
    // Health checks stay open to load balancers.
    assert!(call(admin, "/healthz", "")
        .await
        .starts_with("HTTP/1.1 200"));
}

#[tokio::test]
async fn status_lists_subscribed_resources_with_their_subscribers() {
    let origin = common::serve(|_| {
        let mut r = Response::new(Full::new(Bytes::from("doc")));
        r.headers_mut()
            .insert("etag", http::HeaderValue::from_static("\"e1\""));
        r
    })
    .await;
    let (client, admin) = start(origin, |_| {}).await;
    let mut subs = Vec::new();
    for _ in 0..3 {
        let mut sub = TcpStream::connect(client).await.expect("connect");
        sub.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
            .await
            .expect("write");
        let mut head = [0u8; 12];
        sub.read_exact(&mut head).await.expect("head");
        assert_eq!(&head, b"HTTP/1.1 209");
        subs.push(sub);
    }
    let deadline = Instant::now() + WAIT;
    let doc = loop {
        let answer = call(admin, "/status", "").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let json = answer.split("\r\n\r\n").nth(1).expect("a body");
        let status: serde_json::Value = serde_json::from_str(json).expect("JSON");
        let doc = status["resources"]
            .as_array()
            .and_then(|list| list.iter().find(|r| r["path"] == "/doc").cloned());
        if let Some(doc) = doc.filter(|d| d["subscribers"] == 3 && d["version"] == "\"e1\"") {
            assert!(status["upstream"]["healthy"].as_bool().expect("healthy"));
            let caps = status["memory"].as_array().expect("memory");
            assert!(
                caps.iter().any(|g| g["flag"] == "--state-bytes"
                    && g["cap"] == 256 * 1024 * 1024
                    && g["used"].as_u64().is_some_and(|u| u > 0)),
                "{caps:?}"
            );
            break doc;
        }
        assert!(
            Instant::now() < deadline,
            "no /doc with 3 subscribers: {json}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(doc["feed"], "poll", "{doc}");
    assert_eq!(doc["healthy"], true, "{doc}");
    drop(subs);
}

#[test]
fn a_public_admin_listener_needs_a_token() {
    let args = Args::parse_from(["braid-proxy", "--admin-listen", "0.0.0.0:9090"]);
    let err = Config::from_args(args).expect_err("refused");
    assert!(err.to_string().contains("admin-token"), "{err}");
    let args = Args::parse_from([
        "braid-proxy",
        "--admin-listen",
        "0.0.0.0:9090",
        "--admin-token",
        TOKEN,
    ]);
    assert!(Config::from_args(args).is_ok());
    let short = Args::parse_from(["braid-proxy", "--admin-token", "short"]);
    assert!(
        Config::from_args(short).is_err(),
        "a short token is refused"
    );
}

#[test]
fn the_sample_configuration_names_every_key_and_parses() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/deploy/braid-proxy.toml");
    let text = std::fs::read_to_string(&path).expect("examples/deploy/braid-proxy.toml");
    for key in braid_proxy::config::KEYS {
        assert!(
            text.lines()
                .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} ="))),
            "the sample does not show `{key}`"
        );
    }
    let mut config = Config::default();
    config.apply_toml(&path, &text).expect("the sample parses");
    assert_eq!(config.listen, "0.0.0.0:8080".parse().expect("addr"));
    assert_eq!(config.state_bytes, 256 * 1024 * 1024);
    // With every commented key set too.
    let all: String = text
        .lines()
        .map(|l| {
            l.strip_prefix("# ")
                .filter(|l| l.contains(" = "))
                .unwrap_or(l)
        })
        .collect::<Vec<_>>()
        .join("\n");
    Config::default()
        .apply_toml(&path, &all)
        .expect("every key parses");
}

#[test]
fn the_flag_reference_is_generated_from_the_declarations() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/flags.md");
    let generated = braid_proxy::config::flags_markdown();
    if std::env::var_os("BRAID_PROXY_WRITE_SAMPLE").is_some() {
        std::fs::write(&path, &generated).expect("write the reference");
    }
    let text = std::fs::read_to_string(&path).expect("docs/flags.md");
    assert!(
        text == generated,
        "docs/flags.md differs from config::flags_markdown(); regenerate it with \
         BRAID_PROXY_WRITE_SAMPLE=1 cargo test --test operations generated"
    );
    for key in braid_proxy::config::KEYS {
        assert!(
            text.contains(&format!("| `--{key}` |")),
            "--{key} is not listed"
        );
    }
}

#[test]
fn the_sample_configuration_is_generated_from_the_declarations() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/deploy/braid-proxy.toml");
    let generated = braid_proxy::config::sample_toml();
    if std::env::var_os("BRAID_PROXY_WRITE_SAMPLE").is_some() {
        std::fs::write(&path, &generated).expect("write the sample");
    }
    let text = std::fs::read_to_string(&path).expect("examples/deploy/braid-proxy.toml");
    assert!(
        text == generated,
        "examples/deploy/braid-proxy.toml differs from config::sample_toml(); regenerate it with \
         BRAID_PROXY_WRITE_SAMPLE=1 cargo test --test operations the_sample_configuration_is_generated"
    );
}

/// Starts the binary with its demo origin and `args`, stdout and stderr
/// piped; returns it, the client address its banner names (the text line
/// or, with `--log-format json`, the banner event), and the banner line.
fn spawn_binary(args: &[&str]) -> (std::process::Child, String, String) {
    common::spawn_proxy(
        Command::new(env!("CARGO_BIN_EXE_braid-proxy"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stderr(Stdio::piped()),
    )
}

/// Every line of `text` as a JSON object; panics naming the first that is not.
fn json_lines(text: &str, stream: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("a line on {stream} is not JSON ({e}): {line}"));
            assert!(value.is_object(), "not an object on {stream}: {line}");
            value
        })
        .collect()
}

/// One request (so that an access line is logged), then a graceful
/// shutdown (so that its lines are there too); everything the process
/// wrote on either stream.
fn get_notes_then_stop(child: std::process::Child, addr: &str) -> std::process::Output {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    std::io::Write::write_all(
        &mut stream,
        b"GET /notes.txt HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .expect("write");
    let mut answer = Vec::new();
    std::io::Read::read_to_end(&mut stream, &mut answer).expect("read");
    let stopped = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(stopped.success());
    child.wait_with_output().expect("the proxy ends")
}

#[test]
fn text_logs_into_a_pipe_carry_no_colour_codes() {
    let (child, addr, banner) = spawn_binary(&[]);
    assert!(
        banner.starts_with("braid-proxy listening on http://"),
        "{banner}"
    );
    let output = get_notes_then_stop(child, &addr);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let access = stderr
        .lines()
        .find(|l| l.contains("GET /notes.txt"))
        .unwrap_or_else(|| panic!("an access line: {stderr}"));
    assert!(
        access.contains(" INFO access: GET /notes.txt HTTP/1.1 200 "),
        "{access}"
    );
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a pipe: {stderr:?}"
    );
}

#[test]
fn json_logs_are_one_object_per_line_on_stdout_and_stderr() {
    let (child, addr, banner) =
        spawn_binary(&["--log-format", "json", "--admin-listen", "127.0.0.1:0"]);
    let banner = &json_lines(&banner, "stdout")[0];
    assert_eq!(banner["message"], "braid-proxy listening", "{banner}");
    for field in ["admin", "upstream"] {
        assert!(
            banner[field]
                .as_str()
                .is_some_and(|a| a.starts_with("http://127.0.0.1:")),
            "{field}: {banner}"
        );
    }
    assert_eq!(banner["demo"], true, "{banner}");
    let output = get_notes_then_stop(child, &addr);
    let stdout = json_lines(&String::from_utf8_lossy(&output.stdout), "stdout");
    let stderr = json_lines(&String::from_utf8_lossy(&output.stderr), "stderr");
    assert!(stdout.is_empty(), "only the banner on stdout: {stdout:?}");
    let access = stderr
        .iter()
        .find(|v| v["target"] == "access")
        .unwrap_or_else(|| panic!("an access line: {stderr:?}"));
    assert!(
        access["message"]
            .as_str()
            .is_some_and(|m| m.contains("GET /notes.txt")),
        "{access}"
    );
    assert!(
        access["level"].is_string() && access["timestamp"].is_string(),
        "{access}"
    );
    // Each part of the line is a field of its own.
    let fields = access;
    assert_eq!(fields["method"], "GET", "{access}");
    assert_eq!(fields["path"], "/notes.txt", "{access}");
    assert_eq!(fields["status"], 200, "{access}");
    assert!(fields["duration_ms"].is_number(), "{access}");
    assert!(
        fields["peer"]
            .as_str()
            .is_some_and(|p| p.starts_with("127.0.0.1:")),
        "{access}"
    );
    assert!(fields["cache"].is_string(), "{access}");
    assert!(
        stderr.iter().any(|v| v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("shutting down"))),
        "{stderr:?}"
    );

    // A configuration error, or a flag that does not exist, is a JSON event too.
    for (args, says) in [
        (
            &["--log-format", "json", "--listen", "nowhere"][..],
            "`listen`",
        ),
        (
            &["--log-format=json", "--no-such-flag"][..],
            "--no-such-flag",
        ),
    ] {
        let refused = Command::new(env!("CARGO_BIN_EXE_braid-proxy"))
            .args(args)
            .output()
            .expect("run the binary");
        assert_eq!(refused.status.code(), Some(2));
        assert!(refused.stdout.is_empty());
        let error = json_lines(&String::from_utf8_lossy(&refused.stderr), "stderr");
        assert_eq!(error.len(), 1, "{error:?}");
        assert!(
            error[0]["error"].as_str().is_some_and(|e| e.contains(says)),
            "{}",
            error[0]
        );
    }
}

#[test]
fn the_text_banner_is_unchanged() {
    let (mut child, _, banner) = spawn_binary(&["--admin-listen", "127.0.0.1:0"]);
    assert!(
        banner.starts_with("braid-proxy listening on http://127.0.0.1:"),
        "{banner}"
    );
    let mut rest = String::new();
    let stdout = child.stdout.as_mut().expect("stdout");
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut rest).expect("admin line");
    assert!(
        rest.starts_with("braid-proxy admin listening on http://127.0.0.1:"),
        "{rest}"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// Reads from `stream` until `needle` has arrived (bounded by `WAIT`).
fn read_until(stream: &mut std::net::TcpStream, needle: &str) -> String {
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        let n = std::io::Read::read(stream, &mut buf).expect("read");
        assert!(
            n > 0,
            "closed before {needle:?}: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen);
        if text.contains(needle) {
            return text.into_owned();
        }
    }
    panic!("no {needle:?} in time: {}", String::from_utf8_lossy(&seen));
}

#[test]
fn workers_1_serves_subscriptions_and_writes_on_one_thread() {
    let (mut child, addr, _) = spawn_binary(&["--workers", "1"]);
    let mut sub = std::net::TcpStream::connect(&addr).expect("connect");
    std::io::Write::write_all(
        &mut sub,
        b"GET /notes.txt HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n",
    )
    .expect("subscribe");
    let head = read_until(&mut sub, "\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 209"), "{head}");
    let mut put = std::net::TcpStream::connect(&addr).expect("connect");
    std::io::Write::write_all(
        &mut put,
        b"PUT /notes.txt HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\nConnection: close\r\n\r\none thread wrote\n",
    )
    .expect("put");
    put.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut answer = Vec::new();
    std::io::Read::read_to_end(&mut put, &mut answer).expect("read");
    assert!(
        answer.starts_with(b"HTTP/1.1 2"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    read_until(&mut sub, "one thread wrote");
    let threads = std::fs::read_dir(format!("/proc/{}/task", child.id()))
        .map(|d| d.count())
        .unwrap_or(0);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(threads, 1, "--workers 1 runs the proxy on its main thread");
}

/// The Dockerfile's steps, checked as far as a machine that cannot pull
/// images can: what it copies exists, the build stage installs make (for
/// tikv-jemalloc-sys) and copies `.cargo/` (jemalloc's settings) before
/// it builds, and the image starts with a configuration file rather than
/// flags, so that `docker run IMAGE --listen ...` is not a flag given twice.
#[test]
fn the_dockerfile_copies_what_exists_and_starts_from_its_configuration() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text =
        std::fs::read_to_string(root.join("examples/deploy/Dockerfile")).expect("Dockerfile");
    let steps: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let position = |what: &str| {
        steps
            .iter()
            .position(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no step with {what:?}"))
    };
    assert!(position("install -y --no-install-recommends make") < position("cargo build"));
    assert!(position("COPY .cargo ./.cargo") < position("cargo build"));
    let mut copied = std::collections::HashMap::new();
    for step in steps
        .iter()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from="))
    {
        let parts: Vec<&str> = step.split_whitespace().skip(1).collect();
        let (to, from) = parts.split_last().expect("COPY source and destination");
        for source in from {
            assert!(
                root.join(source).exists(),
                "COPY {source}: not in the repository"
            );
            copied.insert(to.to_string(), source.to_string());
        }
    }
    let entrypoint = steps
        .iter()
        .find(|l| l.starts_with("ENTRYPOINT"))
        .expect("an ENTRYPOINT");
    assert!(!entrypoint.contains("--listen"), "{entrypoint}");
    let config = entrypoint
        .split('"')
        .skip_while(|w| *w != "--config")
        .nth(2)
        .expect("the ENTRYPOINT names --config FILE");
    let source = copied
        .get(config)
        .unwrap_or_else(|| panic!("{config} is not copied into the image"));
    let file = root.join(source).display().to_string();
    let image =
        Config::from_args(Args::parse_from(["braid-proxy", "--config", &file])).expect("loads");
    assert_eq!(image.listen, "0.0.0.0:8080".parse().expect("addr"));
    // A flag after the image name overrides the file.
    let flagged = Args::parse_from(["braid-proxy", "--config", &file, "--listen", "127.0.0.1:9"]);
    assert_eq!(
        Config::from_args(flagged).expect("loads").listen,
        "127.0.0.1:9".parse().expect("addr")
    );
}

/// A listener that cannot bind is named with its own address and flag:
/// an admin port in use is not reported as the client port.
#[test]
fn a_busy_admin_port_is_named_as_the_admin_listener() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = busy.local_addr().expect("addr").to_string();
    let refused = Command::new(env!("CARGO_BIN_EXE_braid-proxy"))
        .args(["--listen", "127.0.0.1:0", "--admin-listen", &taken])
        .output()
        .expect("run the binary");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on {taken} (--admin-listen)")),
        "{stderr}"
    );
    assert!(
        !stderr.contains("127.0.0.1:0"),
        "the client port is not blamed: {stderr}"
    );
    drop(busy);
}

/// `/readyz` says once what failed (it said "upstream unreachable:
/// upstream unreachable: ...").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_dead_upstream_once() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr")
    };
    let (proxy, admin) = common::proxy_for(closed, |_| {}).await;
    let failed = common::get(proxy, "/doc", &[]).await;
    assert_eq!(failed.status(), 502);
    let ready = common::get(admin, "/readyz", &[]).await;
    assert_eq!(ready.status(), 503);
    let text = String::from_utf8_lossy(&common::body_of(ready).await).into_owned();
    assert_eq!(text.matches("unreachable").count(), 1, "{text}");
    assert_eq!(text.matches("upstream").count(), 1, "{text}");
}

/// `/metrics` has the process's resident memory and descriptors under the
/// names Prometheus's clients use, and the build's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_name_the_process_and_the_build() {
    let origin = common::serve(|_| Response::new(http_body_util::Full::new(Bytes::new()))).await;
    let (_, admin) = common::proxy_for(origin, |_| {}).await;
    let text = common::body_of(common::get(admin, "/metrics", &[]).await).await;
    let text = String::from_utf8_lossy(&text).into_owned();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
    };
    assert!(value("process_resident_memory_bytes") > 1e6);
    assert!(value("process_open_fds") >= 3.0);
    assert!(value("process_max_fds") >= value("process_open_fds"));
    let build = format!(
        "braid_proxy_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(value(&build), 1.0);
}

/// `/status` tells the variants of one URL apart: two `Vary`'d tenants of
/// `/doc` are two rows, each naming its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_each_variant() {
    let origin = common::serve(|req| {
        let tenant = common::header_text(req.headers(), "x-tenant").unwrap_or("-".into());
        Response::builder()
            .header("vary", "X-Tenant")
            .header("cache-control", "max-age=60")
            .header("etag", format!("\"{tenant}\""))
            .body(http_body_util::Full::new(Bytes::from(tenant)))
            .expect("response")
    })
    .await;
    let (proxy, admin) = common::proxy_for(origin, |_| {}).await;
    for tenant in ["a", "b"] {
        let answer = common::get(proxy, "/doc", &[("x-tenant", tenant)]).await;
        assert_eq!(common::body_of(answer).await, Bytes::from(tenant));
    }
    let status = common::body_of(common::get(admin, "/status", &[]).await).await;
    let status: serde_json::Value = serde_json::from_slice(&status).expect("json");
    let mut variants: Vec<String> = status["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .filter(|r| r["path"] == "/doc")
        .map(|r| r["variant"].as_str().expect("a variant").to_string())
        .collect();
    variants.sort();
    assert_eq!(variants.len(), 2, "{status}");
    assert!(variants[0].ends_with("x-tenant a"), "{variants:?}");
    assert!(variants[1].ends_with("x-tenant b"), "{variants:?}");
}
