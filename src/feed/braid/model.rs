//! What a session's updates say the resource is now ([`Model`]), and the
//! one update a laggard of a linear stream gets instead of its backlog
//! (the understood patches composed, or a snapshot of the model).

use std::collections::HashMap;

use bytes::Bytes;
use http::header;

use crate::braid::{self, Patch, VersionList};
use crate::floor::sync::lock;
use crate::metrics::Metrics;

use super::*;

/// What a session's updates say the resource is now, when it can tell.
#[derive(Default)]
pub(super) struct Model {
    /// The 209 declared no `Merge-Type`: one server-authoritative history,
    /// so laggards may be sent one update to the newest version.
    pub(super) linear: bool,
    pub(super) known: Option<Known>,
}

/// A representation built from the upstream's updates.
#[derive(Clone)]
pub(super) struct Known {
    pub(super) version: VersionList,
    /// The status of the newest update (`None`: 200).
    pub(super) status: Option<u16>,
    pub(super) body: Bytes,
    /// The representation headers its last snapshot carried (`Content-Type`, ...).
    pub(super) headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

/// How an update took the model from its parents to its version.
pub(super) enum Applied {
    /// The whole body.
    Snapshot,
    /// These patches against the previous version.
    Patches(Vec<Patch>),
}

impl Model {
    /// Bytes it holds: the representation's body and headers. A body that
    /// shares an update's bytes is counted too: the window may drop or
    /// replace that update while the model keeps them.
    pub(super) fn weight(&self) -> usize {
        self.known.as_ref().map_or(0, |k| {
            k.body.len()
                + k.headers
                    .iter()
                    .map(|(n, v)| n.as_str().len() + v.len() + 32)
                    .sum::<usize>()
        })
    }

    /// The update bytes its body shares were replaced by `new` (the same
    /// bytes and more): share those instead, so the old ones are freed.
    pub(super) fn rebase(&mut self, old: &Bytes, new: &Bytes) {
        let Some(known) = self.known.as_mut() else {
            return;
        };
        let (start, end) = (old.as_ptr() as usize, old.as_ptr() as usize + old.len());
        let body = known.body.as_ptr() as usize;
        if known.body.is_empty() || body < start || body + known.body.len() > end {
            return;
        }
        let at = body - start;
        if new.get(at..at + known.body.len()) == Some(&known.body[..]) {
            known.body = new.slice(at..at + known.body.len());
        }
    }

    /// Applies one update received; what it did, or `None` when the
    /// update cannot be applied (the model is unknown from then on, until
    /// a snapshot).
    pub(super) fn understand(&mut self, raw: &Bytes, max_body: usize) -> Option<Applied> {
        let applied = self.apply(raw, max_body);
        if applied.is_none() {
            self.known = None;
        }
        applied
    }

    pub(super) fn apply(&mut self, raw: &Bytes, max_body: usize) -> Option<Applied> {
        if !self.linear {
            return None;
        }
        let mut decoder = braid::Decoder::new(braid::DecodeLimits {
            max_content_length: max_body,
            ..braid::DecodeLimits::default()
        });
        decoder.push(raw);
        let update = decoder.next_update().ok()??;
        if update.version.is_empty() {
            return None;
        }
        match update.body {
            braid::Body::Snapshot(_)
                if update
                    .extra_headers
                    .iter()
                    .any(|(name, _)| name == header::CONTENT_ENCODING) =>
            {
                // A coded body: patches of it mean nothing here.
                None
            }
            braid::Body::Snapshot(body) => {
                let headers = update
                    .extra_headers
                    .into_iter()
                    .filter(|(name, _)| SNAPSHOT_HEADERS.contains(&name.as_str()))
                    .collect();
                // The update's own bytes end with its body: share them
                // rather than keep a second copy.
                let body = match raw.len().checked_sub(body.len()) {
                    Some(at) if raw[at..] == body[..] => raw.slice(at..),
                    _ => body,
                };
                self.known = Some(Known {
                    version: update.version,
                    status: update.status,
                    body,
                    headers,
                });
                Some(Applied::Snapshot)
            }
            braid::Body::Patches(patches) => {
                let known = self.known.as_mut()?;
                let ok_status = known.status.unwrap_or(200) == 200;
                // A patch is to a 200's body, and says 200 if anything
                // (braid-http 1.4's server starts every update with
                // `HTTP 200 OK`).
                let patch_ok = update.status.unwrap_or(200) == 200;
                if update.parents != known.version || !ok_status || !patch_ok {
                    return None;
                }
                if patches.iter().any(|p| p.unit == braid::RangeUnit::Json) {
                    return None;
                }
                let body = braid::apply_patches(&known.body, &patches).ok()?;
                if body.len() > max_body {
                    return None;
                }
                known.body = Bytes::from(body);
                known.version = update.version;
                Some(Applied::Patches(patches))
            }
        }
    }
}

/// Headers of a snapshot update that describe the representation, kept
/// with the model for GETs and collapsed snapshots.
pub(super) const SNAPSHOT_HEADERS: [&str; 2] = ["content-type", "content-language"];

impl Session {
    /// One update taking a subscriber at entry `from` to `end` (the newest
    /// announced) when it is more than one update behind, or fell out of
    /// the window, and the stream is linear: the understood patches
    /// composed, or a snapshot of the model. Built once per (from, end)
    /// and shared by every laggard there; `None`: send what was received.
    pub(super) fn collapsed(&self, from: u64, end: u64, metrics: &Metrics) -> Option<Bytes> {
        {
            let mut cache = lock(&self.collapsed);
            if cache.0 != end {
                *cache = (end, HashMap::new());
            }
            if let Some(hit) = cache.1.get(&from) {
                return hit.clone();
            }
        }
        let built = self.collapse(from, end);
        if built.is_some() {
            Metrics::inc(&metrics.collapsed_total);
        }
        let mut cache = lock(&self.collapsed);
        if cache.0 == end {
            cache.1.insert(from, built.clone());
        }
        built
    }

    pub(super) fn collapse(&self, from: u64, end: u64) -> Option<Bytes> {
        let window = lock(&self.window);
        let model = lock(&self.model);
        if !model.linear || window.malformed {
            return None;
        }
        let fell_out = from < window.first;
        let start = usize::try_from(from.saturating_sub(window.first)).ok()?;
        let stop = usize::try_from(end.checked_sub(window.first)?)
            .ok()?
            .min(window.entries.len());
        let behind: Vec<&Entry> = window
            .entries
            .range(start.min(stop)..stop)
            .filter(|e| !e.blank)
            .collect();
        if behind.len() <= 1 && !fell_out {
            return None;
        }
        // An update without a `Version` (an in-stream status such as a 403,
        // or an unversioned message) changes no version, so no collapse
        // can stand for it: one still in the window is sent as received.
        if !fell_out && behind.iter().any(|e| e.version.is_none()) {
            return None;
        }
        // The newest update it is to be taken to.
        let newest = window
            .entries
            .range(..stop)
            .rev()
            .find(|e| !e.blank)?
            .version
            .clone()?;
        // The version the subscriber has: the update before `from`.
        let have = if fell_out {
            None
        } else if from == 0 {
            self.opened_with.clone()
        } else {
            window
                .entries
                .range(..start)
                .rev()
                .find(|e| !e.blank)
                .and_then(|e| e.version.clone())
        };
        let mut composed: Option<Vec<Patch>> = None;
        let mut patches_do = have.is_some();
        for entry in &behind {
            match entry.applied.as_deref() {
                Some(Applied::Patches(p)) if patches_do => {
                    composed = match composed {
                        None => Some(p.clone()),
                        Some(done) => braid::compose(&done, p).ok(),
                    };
                    patches_do = composed.is_some();
                }
                _ => patches_do = false,
            }
        }
        let snapshot = model
            .known
            .as_ref()
            .filter(|k| k.version == newest)
            .map(|k| (braid::Body::Snapshot(k.body.clone()), k));
        let composed = composed.filter(|patches| {
            patches_do
                && snapshot.as_ref().is_none_or(|(_, known)| {
                    braid::patches_wire_len(patches) <= known.body.len() + 128
                })
        });
        let (body, known) = match composed {
            Some(patches) => (braid::Body::Patches(patches), None),
            None => {
                let (body, known) = snapshot?;
                (body, Some(known))
            }
        };
        Some(braid::encode(&braid::Update {
            status: known.and_then(|k| k.status),
            version: newest,
            parents: have.unwrap_or_default(),
            body,
            extra_headers: known.map(|k| k.headers.clone()).unwrap_or_default(),
        }))
    }
}
