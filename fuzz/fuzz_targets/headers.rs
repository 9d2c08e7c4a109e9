//! The request header parsers on arbitrary input: no panics, and a parsed
//! version list re-parses from its own formatting to the same list.
#![no_main]

use braid_proxy::braid::{parse_heartbeats, parse_subscribe, Patch, RangeUnit, VersionList};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(list) = VersionList::parse(data) {
        let again = VersionList::parse(list.to_header_value().as_bytes()).expect("own output parses");
        assert_eq!(again, list);
        assert!(list.to_header_value().is_ascii());
    }
    let _ = parse_subscribe(data);
    let _ = parse_heartbeats(data);
    let range = String::from_utf8_lossy(data).into_owned();
    let _ = Patch { unit: RangeUnit::Text, range, content: bytes::Bytes::new() }.span();
});
