//! The servers' processes as the load generators measure them
//! (`examples/fanout.rs`, `examples/handshakes.rs`): a process tree, its
//! CPU time and memory from /proc, and percentiles.
//!
//! Included by `#[path]` from both examples; not an example of its own.

#![allow(dead_code)]

use std::collections::HashMap;

/// The process `root` and all its descendants, from /proc.
pub fn process_tree(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() && out.len() < 1000 {
        if let Some(c) = children.get(&out[i]) {
            out.extend(c);
        }
        i += 1;
    }
    out
}

/// CPU seconds, VmRSS, VmHWM and Pss (KiB), summed over processes.
#[derive(Clone, Copy, Default, Debug)]
pub struct Usage {
    pub cpu: f64,
    pub rss: u64,
    pub hwm: u64,
    pub pss: u64,
    pub processes: usize,
}

fn status_field(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub fn usage(pids: &[u32]) -> Usage {
    let mut u = Usage::default();
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        if fields.is_empty() {
            continue;
        }
        u.processes += 1;
        // After the command: utime and stime are fields 14 and 15 (1-based), in ticks of 1/100 s.
        let ticks: u64 = [11, 12]
            .iter()
            .filter_map(|&i| fields.get(i).and_then(|v| v.parse::<u64>().ok()))
            .sum();
        u.cpu += ticks as f64 / 100.0;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        u.rss += status_field(&status, "VmRSS:");
        u.hwm += status_field(&status, "VmHWM:");
        let rollup =
            std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        u.pss += status_field(&rollup, "Pss:");
    }
    u
}

/// The `p` percentile of sorted µs values, in ms.
pub fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    f64::from(sorted[i]) / 1000.0
}
