//! Property tests of the pure logic: diff → apply is the identity, and
//! composing two patch lists equals applying them one after the other.

use std::time::{Duration, Instant};

use braid_proxy::braid::{apply_patches, compose};
use braid_proxy::diff::diff;
use proptest::prelude::*;

fn later() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Text with ASCII, Latin-1, CJK, astral emoji and combining marks, and
/// long shared runs so the diffs are not trivial.
fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("a".to_string()),
            Just("hello ".to_string()),
            Just("é".to_string()),
            Just("e\u{301}".to_string()),
            Just("日本".to_string()),
            Just("😀".to_string()),
            Just("👨‍👩‍👧".to_string()),
            Just("\n".to_string()),
            "[a-z]{0,3}".prop_map(|s| s),
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #[test]
    fn text_diff_applies_to_the_new_text(old in text(), new in text()) {
        let out = diff(old.as_bytes(), new.as_bytes(), true, later());
        let applied = apply_patches(old.as_bytes(), &out.patches).expect("patches apply");
        prop_assert_eq!(String::from_utf8(applied).expect("utf-8"), new);
    }

    #[test]
    fn byte_diff_applies_to_the_new_bytes(
        old in proptest::collection::vec(any::<u8>(), 0..300),
        new in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let out = diff(&old, &new, false, later());
        prop_assert_eq!(apply_patches(&old, &out.patches).expect("patches apply"), new);
    }

    #[test]
    fn invalid_utf8_declared_as_text_falls_back_to_bytes(
        old in proptest::collection::vec(any::<u8>(), 0..100),
        new in proptest::collection::vec(any::<u8>(), 0..100),
    ) {
        let out = diff(&old, &new, true, later());
        prop_assert_eq!(apply_patches(&old, &out.patches).expect("patches apply"), new);
    }

    #[test]
    fn compose_equals_sequential_application(a in text(), b in text(), c in text()) {
        let p1 = diff(a.as_bytes(), b.as_bytes(), true, later()).patches;
        let p2 = diff(b.as_bytes(), c.as_bytes(), true, later()).patches;
        // Both lists must share a unit to compose; the empty list is unit-less.
        let composed = compose(&p1, &p2).expect("compose");
        let applied = apply_patches(a.as_bytes(), &composed).expect("composed patches apply");
        prop_assert_eq!(String::from_utf8(applied).expect("utf-8"), c);
    }

    #[test]
    fn compose_bytes(
        a in proptest::collection::vec(0u8..4, 0..60),
        b in proptest::collection::vec(0u8..4, 0..60),
        c in proptest::collection::vec(0u8..4, 0..60),
    ) {
        let p1 = diff(&a, &b, false, later()).patches;
        let p2 = diff(&b, &c, false, later()).patches;
        let composed = compose(&p1, &p2).expect("compose");
        prop_assert_eq!(apply_patches(&a, &composed).expect("apply"), c);
    }
}

#[test]
fn a_small_edit_to_a_100kb_document_costs_under_1kb() {
    let old: String = (0..3000)
        .map(|i| format!("line {i}: some text of the document\n"))
        .collect();
    assert!(old.len() > 100_000);
    let new = old.replacen("line 1234: some", "line 1234: edited", 1);
    let out = diff(old.as_bytes(), new.as_bytes(), true, later());
    let bytes: usize = braid_proxy::braid::patches_wire_len(&out.patches);
    assert!(
        bytes < 1024,
        "patches take {bytes} bytes: {:?}",
        out.patches
    );
    assert_eq!(
        apply_patches(old.as_bytes(), &out.patches).expect("apply"),
        new.as_bytes()
    );
}
