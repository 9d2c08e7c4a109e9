//! Old body + new body → patches, with `similar` (Myers, bounded by a
//! deadline). Text is diffed in Unicode code points, everything else in
//! bytes. The common prefix and suffix are trimmed first, so a small edit
//! to a large document costs little more than the edit.

use std::time::Instant;

use similar::{capture_diff_slices_deadline, Algorithm, DiffOp};

use crate::braid::Patch;

/// The patches, and whether the deadline passed (the result is still
/// correct, but may be larger than needed).
#[derive(Debug)]
pub struct DiffOutcome {
    pub patches: Vec<Patch>,
    pub timed_out: bool,
}

/// Diffs `old` against `new`. With `text`, both must be UTF-8 to be diffed
/// as code points; otherwise they are diffed as bytes.
pub fn diff(old: &[u8], new: &[u8], text: bool, deadline: Instant) -> DiffOutcome {
    if text {
        if let (Ok(a), Ok(b)) = (std::str::from_utf8(old), std::str::from_utf8(new)) {
            let a: Vec<char> = a.chars().collect();
            let b: Vec<char> = b.chars().collect();
            return diff_units(&a, &b, deadline, |s, e, c: &[char]| {
                Patch::text(s, e, c.iter().collect::<String>())
            });
        }
    }
    diff_units(old, new, deadline, |s, e, c: &[u8]| {
        Patch::bytes(s, e, c.to_vec())
    })
}

fn diff_units<T: Eq + std::hash::Hash + Ord>(
    old: &[T],
    new: &[T],
    deadline: Instant,
    make: impl Fn(usize, usize, &[T]) -> Patch,
) -> DiffOutcome {
    let prefix = old.iter().zip(new).take_while(|(a, b)| a == b).count();
    let max_suffix = old.len().min(new.len()) - prefix;
    let suffix = old[prefix..]
        .iter()
        .rev()
        .zip(new[prefix..].iter().rev())
        .take(max_suffix)
        .take_while(|(a, b)| a == b)
        .count();
    let a = &old[prefix..old.len() - suffix];
    let b = &new[prefix..new.len() - suffix];
    let mut patches = Vec::new();
    if a.is_empty() && b.is_empty() {
        return DiffOutcome {
            patches,
            timed_out: false,
        };
    }
    if a.is_empty() || b.is_empty() {
        patches.push(make(prefix, prefix + a.len(), b));
        return DiffOutcome {
            patches,
            timed_out: false,
        };
    }
    let ops = capture_diff_slices_deadline(Algorithm::Myers, a, b, Some(deadline));
    let timed_out = Instant::now() > deadline;
    // Group every run of non-equal ops into one replace patch. Positions
    // are tracked from the ops' lengths alone: similar's Myers can report
    // odd indices on Insert and Delete ops.
    let (mut o, mut n) = (0usize, 0usize);
    let mut run: Option<(usize, usize)> = None; // where the run starts in old and new
    for op in ops {
        let (old_len, new_len, equal) = match op {
            DiffOp::Equal { len, .. } => (len, len, true),
            DiffOp::Delete { old_len, .. } => (old_len, 0, false),
            DiffOp::Insert { new_len, .. } => (0, new_len, false),
            DiffOp::Replace {
                old_len, new_len, ..
            } => (old_len, new_len, false),
        };
        if equal {
            if let Some((os, ns)) = run.take() {
                patches.push(make(prefix + os, prefix + o, &b[ns..n]));
            }
        } else if run.is_none() {
            run = Some((o, n));
        }
        o += old_len;
        n += new_len;
    }
    if let Some((os, ns)) = run {
        patches.push(make(prefix + os, prefix + o, &b[ns..n]));
    }
    DiffOutcome { patches, timed_out }
}

/// True for content types diffed and ranged as text: `text/*`, JSON and
/// `+json`, XML and `+xml`, JavaScript.
pub fn is_text_content_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence.starts_with("text/")
        || essence.ends_with("+json")
        || essence.ends_with("+xml")
        || matches!(
            essence.as_str(),
            "application/json"
                | "application/xml"
                | "application/javascript"
                | "application/ecmascript"
                | "application/x-javascript"
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::braid::apply_patches;
    use std::time::Duration;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn small_edit_in_a_large_text_is_small() {
        let old = "lorem ipsum dolor sit amet\n".repeat(4000);
        let mut new = old.clone();
        new.insert_str(50_000, "é!");
        let out = diff(old.as_bytes(), new.as_bytes(), true, later());
        let size: usize = out
            .patches
            .iter()
            .map(|p| p.content.len() + p.range.len())
            .sum();
        assert!(size < 64, "{:?}", out.patches);
        assert_eq!(
            apply_patches(old.as_bytes(), &out.patches).unwrap(),
            new.as_bytes()
        );
    }

    #[test]
    fn content_types() {
        assert!(is_text_content_type("text/plain; charset=utf-8"));
        assert!(is_text_content_type("application/vnd.api+json"));
        assert!(is_text_content_type("Application/JSON"));
        assert!(!is_text_content_type("image/png"));
        assert!(!is_text_content_type("application/octet-stream"));
    }
}
