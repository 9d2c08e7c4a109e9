//! Applying and composing patches. Ranges are absolute against the document
//! *before* the update, sorted by start and not overlapping (braid-text's
//! convention); text ranges count Unicode code points, bytes ranges bytes.

use bytes::Bytes;

use super::{Patch, RangeUnit};

/// Why patches could not be applied or composed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchError {
    #[error("patch range {0:?} is not of the form [a:b]")]
    BadRange(String),
    #[error("patch ranges overlap or are out of order")]
    Overlap,
    #[error("patch range ends at {end}, past the document's length {len}")]
    OutOfBounds { end: usize, len: usize },
    #[error("text patch on a document or content that is not UTF-8")]
    NotUtf8,
    #[error("patches mix units or use a unit the proxy cannot apply")]
    Unit,
}

/// One edit of a document, in units (code points or bytes).
#[derive(Debug, Clone)]
enum Op<T> {
    Retain(usize),
    Delete(usize),
    Insert(Vec<T>),
}

/// The unit all patches share (empty lists count as bytes).
fn common_unit(patches: &[Patch]) -> Result<RangeUnit, PatchError> {
    let unit = patches.first().map_or(RangeUnit::Bytes, |p| p.unit);
    if unit == RangeUnit::Json || patches.iter().any(|p| p.unit != unit) {
        return Err(PatchError::Unit);
    }
    Ok(unit)
}

fn spans(patches: &[Patch]) -> Result<Vec<(usize, usize)>, PatchError> {
    let mut out = Vec::with_capacity(patches.len());
    let mut last_end = 0;
    for p in patches {
        let (a, b) = p
            .span()
            .ok_or_else(|| PatchError::BadRange(p.range.clone()))?;
        if a < last_end {
            return Err(PatchError::Overlap);
        }
        last_end = b;
        out.push((a, b));
    }
    Ok(out)
}

fn script<T>(
    patches: &[Patch],
    split: &impl Fn(&Bytes) -> Option<Vec<T>>,
) -> Result<Vec<Op<T>>, PatchError> {
    common_unit(patches)?;
    let mut ops = Vec::with_capacity(patches.len() * 3);
    let mut pos = 0;
    for (p, (a, b)) in patches.iter().zip(spans(patches)?) {
        if a > pos {
            ops.push(Op::Retain(a - pos));
        }
        if b > a {
            ops.push(Op::Delete(b - a));
        }
        let content = split(&p.content).ok_or(PatchError::NotUtf8)?;
        if !content.is_empty() {
            ops.push(Op::Insert(content));
        }
        pos = b;
    }
    Ok(ops)
}

fn text_units(b: &Bytes) -> Option<Vec<char>> {
    std::str::from_utf8(b).ok().map(|s| s.chars().collect())
}

fn byte_units(b: &Bytes) -> Option<Vec<u8>> {
    Some(b.to_vec())
}

/// Applies patches to a document.
pub fn apply_patches(old: &[u8], patches: &[Patch]) -> Result<Vec<u8>, PatchError> {
    match common_unit(patches)? {
        RangeUnit::Text => {
            let doc: Vec<char> = std::str::from_utf8(old)
                .map_err(|_| PatchError::NotUtf8)?
                .chars()
                .collect();
            let out = run(&doc, &script(patches, &text_units)?)?;
            Ok(out.into_iter().collect::<String>().into_bytes())
        }
        _ => run(old, &script(patches, &byte_units)?),
    }
}

fn run<T: Clone>(doc: &[T], ops: &[Op<T>]) -> Result<Vec<T>, PatchError> {
    let mut out = Vec::with_capacity(doc.len());
    let mut pos = 0;
    for op in ops {
        match op {
            Op::Retain(n) | Op::Delete(n) => {
                let end = pos + n;
                if end > doc.len() {
                    return Err(PatchError::OutOfBounds {
                        end,
                        len: doc.len(),
                    });
                }
                if matches!(op, Op::Retain(_)) {
                    out.extend_from_slice(&doc[pos..end]);
                }
                pos = end;
            }
            Op::Insert(content) => out.extend_from_slice(content),
        }
    }
    out.extend_from_slice(&doc[pos..]);
    Ok(out)
}

/// Composes `first` (A → B) and `second` (B → C) into one patch list A → C.
pub fn compose(first: &[Patch], second: &[Patch]) -> Result<Vec<Patch>, PatchError> {
    if first.is_empty() {
        return Ok(second.to_vec());
    }
    if second.is_empty() {
        return Ok(first.to_vec());
    }
    let unit = common_unit(first)?;
    if common_unit(second)? != unit {
        return Err(PatchError::Unit);
    }
    match unit {
        RangeUnit::Text => {
            let ops = compose_ops(script(first, &text_units)?, script(second, &text_units)?);
            Ok(to_patches(ops, |c: Vec<char>| {
                Patch::text(0, 0, c.into_iter().collect::<String>())
            }))
        }
        _ => {
            let ops = compose_ops(script(first, &byte_units)?, script(second, &byte_units)?);
            Ok(to_patches(ops, |c: Vec<u8>| Patch::bytes(0, 0, c)))
        }
    }
}

fn compose_ops<T: Clone>(first: Vec<Op<T>>, second: Vec<Op<T>>) -> Vec<Op<T>> {
    let mut out: Vec<Op<T>> = Vec::new();
    let mut a = first.into_iter();
    let mut pending: Option<Op<T>> = a.next();
    for op in second {
        match op {
            Op::Insert(content) => out.push(Op::Insert(content)),
            Op::Retain(mut n) | Op::Delete(mut n) => {
                let deleting = matches!(op, Op::Delete(_));
                while n > 0 {
                    match pending.take() {
                        // Past the end of `first`: the rest of A is retained.
                        None => {
                            out.push(if deleting {
                                Op::Delete(n)
                            } else {
                                Op::Retain(n)
                            });
                            n = 0;
                        }
                        Some(Op::Delete(d)) => {
                            out.push(Op::Delete(d));
                            pending = a.next();
                        }
                        Some(Op::Retain(r)) => {
                            let take = r.min(n);
                            out.push(if deleting {
                                Op::Delete(take)
                            } else {
                                Op::Retain(take)
                            });
                            n -= take;
                            pending = if r > take {
                                Some(Op::Retain(r - take))
                            } else {
                                a.next()
                            };
                        }
                        Some(Op::Insert(mut content)) => {
                            let take = content.len().min(n);
                            let rest = content.split_off(take);
                            if !deleting {
                                out.push(Op::Insert(content));
                            }
                            n -= take;
                            pending = if rest.is_empty() {
                                a.next()
                            } else {
                                Some(Op::Insert(rest))
                            };
                        }
                    }
                }
            }
        }
    }
    out.extend(pending);
    out.extend(a);
    out
}

/// Turns an edit script back into sorted, merged patches against A.
fn to_patches<T>(ops: Vec<Op<T>>, make: impl Fn(Vec<T>) -> Patch) -> Vec<Patch> {
    let mut patches = Vec::new();
    let mut pos = 0;
    let mut current: Option<(usize, usize, Vec<T>)> = None;
    let flush = |current: &mut Option<(usize, usize, Vec<T>)>, patches: &mut Vec<Patch>| {
        if let Some((start, end, content)) = current.take() {
            if end > start || !content.is_empty() {
                let mut p = make(content);
                p.range = format!("[{start}:{end}]");
                patches.push(p);
            }
        }
    };
    for op in ops {
        match op {
            Op::Retain(n) => {
                if n > 0 {
                    flush(&mut current, &mut patches);
                }
                pos += n;
            }
            Op::Delete(n) => {
                let entry = current.get_or_insert_with(|| (pos, pos, Vec::new()));
                entry.1 += n;
                pos += n;
            }
            Op::Insert(content) => {
                let entry = current.get_or_insert_with(|| (pos, pos, Vec::new()));
                entry.2.extend(content);
            }
        }
    }
    flush(&mut current, &mut patches);
    patches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_several_absolute_patches() {
        let out = apply_patches(
            b"hello world",
            &[Patch::text(0, 1, "J"), Patch::text(6, 11, "there")],
        )
        .unwrap();
        assert_eq!(out, b"Jello there");
    }

    #[test]
    fn text_counts_code_points() {
        let out = apply_patches("a😀b".as_bytes(), &[Patch::text(1, 2, "é")]).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "aéb");
    }

    #[test]
    fn compose_matches_sequential_application() {
        let a = "the quick brown fox";
        let p1 = vec![Patch::text(4, 9, "slow"), Patch::text(19, 19, "!")];
        let b = apply_patches(a.as_bytes(), &p1).unwrap();
        let p2 = vec![Patch::text(0, 3, "A"), Patch::text(7, 13, "")];
        let c = apply_patches(&b, &p2).unwrap();
        let composed = compose(&p1, &p2).unwrap();
        assert_eq!(apply_patches(a.as_bytes(), &composed).unwrap(), c);
    }

    #[test]
    fn errors() {
        assert_eq!(
            apply_patches(b"abc", &[Patch::bytes(2, 9, "")]),
            Err(PatchError::OutOfBounds { end: 9, len: 3 })
        );
        assert_eq!(
            apply_patches(b"abc", &[Patch::bytes(1, 2, ""), Patch::bytes(0, 1, "")]),
            Err(PatchError::Overlap)
        );
    }
}
