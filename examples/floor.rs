//! The delivery floor (issue 20): the least a server can do per delivery
//! and still put one update on every subscriber's TCP socket. It is a
//! measuring stick for `examples/fanout.rs`, not a server to deploy.
//!
//! One thread. A subscriber sends `GET /sub` and gets a head with no
//! length, then only raw updates; a publisher sends `POST /pub` with the
//! update as its body and gets `204`, and then the one thread writes the
//! body to every subscriber's socket in turn: one send system call each, with no
//! framing, no version, no state, no wake-up of anything. The sockets are
//! set up as braid-proxy sets up its own (`TCP_NODELAY`, and
//! `TCP_NOTSENT_LOWAT` of 16 KiB); a subscriber whose socket takes less
//! than the whole update is dropped. A body over 64 KiB gets `413`.
//!
//! It speaks what `fanout --system nchan` speaks, so the same generator
//! measures it (`--system floor` names it so in the report):
//!
//! ```sh
//! cargo build --release --examples
//! ulimit -n 20000
//! taskset -c 0 target/release/examples/floor 127.0.0.1:18090 &
//! taskset -c 1 target/release/examples/fanout --system floor \
//!     --target 127.0.0.1:18090 --server-pid $! --subs 10000 --rate 10 --updates 200
//! ```
//!
//! A port of 0 picks a free one; the address is printed on stderr
//! (`floor: listening on ADDR`). On exit (SIGINT or SIGTERM, or after
//! `--secs`) it prints the time each update's sweep of all sockets took
//! (JSON on stdout) and their p50/p99 (stderr).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The largest request head or published body read.
const MAX_REQUEST: usize = 64 * 1024;

#[derive(Default)]
struct Floor {
    subs: Vec<TcpStream>,
    /// (subscribers written, microseconds the sweep took), per update.
    sweeps: Vec<(usize, u64)>,
    dropped: usize,
}

fn main() {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("usage: floor 127.0.0.1:PORT [--secs S]"));
    assert!(
        addr.ip().is_loopback(),
        "the floor listens on loopback only"
    );
    let secs: u64 = match (args.next().as_deref(), args.next()) {
        (Some("--secs"), Some(s)) => s.parse().expect("--secs S"),
        _ => 3600,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    let floor = Rc::new(RefCell::new(Floor::default()));
    local.block_on(&rt, serve(addr, floor.clone(), Duration::from_secs(secs)));
    report(&floor.borrow());
}

async fn serve(addr: SocketAddr, floor: Rc<RefCell<Floor>>, secs: Duration) {
    let listener = TcpListener::bind(addr).await.expect("bind");
    let bound = listener.local_addr().expect("local address");
    eprintln!("floor: listening on {bound}");
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
    let stop = tokio::time::sleep(secs);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                tokio::task::spawn_local(connection(stream, floor.clone()));
            }
        }
    }
}

/// Reads one request; a subscriber joins the list, a publish is swept out.
async fn connection(mut stream: TcpStream, floor: Rc<RefCell<Floor>>) {
    let mut buf = Vec::with_capacity(1024);
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_REQUEST {
            return;
        }
        match stream.read_buf(&mut buf).await {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    };
    if buf.starts_with(b"GET /sub ") {
        let _ = stream.set_nodelay(true);
        let _ = socket2::SockRef::from(&stream).set_tcp_notsent_lowat(16 * 1024);
        let head =
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nCache-Control: no-cache\r\n\r\n";
        if stream.write_all(head).await.is_ok() {
            floor.borrow_mut().subs.push(stream);
        }
    } else if buf.starts_with(b"POST /pub ") {
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if len > MAX_REQUEST {
            let _ = stream
                .write_all(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .await;
            return;
        }
        while buf.len() < head_end + len {
            match stream.read_buf(&mut buf).await {
                Ok(n) if n > 0 => {}
                _ => return,
            }
        }
        let body = buf[head_end..head_end + len].to_vec();
        let _ = stream
            .write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            .await;
        drop(stream);
        sweep(&mut floor.borrow_mut(), &body);
    } else {
        let _ = stream
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await;
    }
}

/// One write per subscriber, in turn, timed.
fn sweep(floor: &mut Floor, body: &[u8]) {
    let start = Instant::now();
    let before = floor.subs.len();
    floor
        .subs
        .retain(|s| matches!(s.try_write(body), Ok(n) if n == body.len()));
    let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
    floor.dropped += before - floor.subs.len();
    let written = floor.subs.len();
    floor.sweeps.push((written, micros));
}

fn report(floor: &Floor) {
    let json = serde_json::json!({"sweeps": floor.sweeps, "dropped": floor.dropped});
    println!("{json}");
    let mut us: Vec<u64> = floor.sweeps.iter().map(|&(_, us)| us).collect();
    us.sort_unstable();
    if let (Some(p50), Some(p99)) = (us.get(us.len() / 2), us.get(us.len() * 99 / 100)) {
        let (writes, micros) = floor
            .sweeps
            .iter()
            .fold((0usize, 0u64), |(w, t), &(n, us)| (w + n, t + us));
        let per = micros as f64 / writes.max(1) as f64;
        eprintln!(
            "floor: {} sweeps, p50 {:.1} ms, p99 {:.1} ms; {per:.2} us per write on average; {} dropped",
            us.len(),
            *p50 as f64 / 1000.0,
            *p99 as f64 / 1000.0,
            floor.dropped
        );
    }
}
