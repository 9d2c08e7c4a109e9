//! The direction of the layers holds (issue 46): every `crate::` path in
//! src/, outside test code and comments, names a top-level module on a
//! lower line of the layer list in src/lib.rs's docs. The list is read
//! from lib.rs, so the docs and the check cannot drift apart; a module
//! missing from the list, or a path that goes up or sideways, fails with
//! the file, the line and the two layers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The layers as lib.rs lists them: module name → line number (1 = top).
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let Some(rest) = line.strip_prefix("//! ") else {
            continue;
        };
        let Some((number, names)) = rest.split_once(". ") else {
            continue;
        };
        let Ok(number) = number.trim().parse::<usize>() else {
            continue;
        };
        for name in names.split(',') {
            let name = name.trim().trim_matches('`');
            assert!(
                out.insert(name.to_string(), number).is_none(),
                "{name} is listed twice"
            );
        }
    }
    out
}

/// Every .rs file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` with comments, string and char literals blanked (newlines kept,
/// so line numbers stay), and every item under `#[cfg(test)]` removed.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            while i < b.len() && !b[i..].starts_with(b"*/") {
                blank(&mut out, b[i]);
                i += 1;
            }
            i += 2;
        } else if b[i] == b'r' && matches!(b.get(i + 1), Some(b'"' | b'#')) && !ident(b, i) {
            // A raw string: r"...", r#"..."#.
            let mut j = i + 1;
            let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
            j += hashes;
            if b.get(j) != Some(&b'"') {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let end: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            j += 1;
            while j < b.len() && !b[j..].starts_with(&end) {
                blank(&mut out, b[j]);
                j += 1;
            }
            i = j + end.len();
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                }
                i += 1;
            }
            i += 1;
        } else if b[i] == b'\'' && char_literal_end(b, i).is_some() {
            i = char_literal_end(b, i).expect("checked");
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let code = String::from_utf8_lossy(&out).into_owned();
    drop_test_items(&code)
}

fn ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Where a char literal starting at `i` ends (after its closing quote);
/// `None` for a lifetime.
fn char_literal_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i + 1)? {
        b'\\' => {
            let close = b[i + 2..].iter().take(10).position(|&c| c == b'\'')?;
            Some(i + 2 + close + 1)
        }
        _ => {
            // One UTF-8 character, then a quote.
            let len = match b[i + 1] {
                c if c < 0x80 => 1,
                c if c >= 0xf0 => 4,
                c if c >= 0xe0 => 3,
                _ => 2,
            };
            (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 2 + len)
        }
    }
}

/// Removes each item that follows a `#[cfg(test)]` (to its closing brace,
/// or its semicolon), keeping the newlines.
fn drop_test_items(code: &str) -> String {
    let mut out = code.as_bytes().to_vec();
    let mut from = 0;
    while let Some(at) = code[from..].find("#[cfg(test)]").map(|a| a + from) {
        let b = code.as_bytes();
        let mut j = at;
        let mut depth = 0usize;
        while j < b.len() {
            match b[j] {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                b';' if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        for c in &mut out[at..j.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        from = j.min(b.len());
    }
    String::from_utf8(out).expect("ascii blanks")
}

/// The top-level module a source file belongs to (`None`: the crate root
/// or the binary).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
    (!matches!(name.as_str(), "lib" | "main")).then_some(name)
}

#[test]
fn every_import_points_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let layers = layers(&lib);
    assert!(layers.len() > 10, "the layer list was not found in lib.rs");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    let mut seen = 0;
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        let Some(&own) = layers.get(&module) else {
            wrong.push(format!(
                "{}: module `{module}` is not in lib.rs's layer list",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read");
        let code = code_only(&text);
        for (n, line) in code.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("crate::") {
                let after = &rest[at + "crate::".len()..];
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &after[name.len()..];
                if name == module {
                    continue;
                }
                seen += 1;
                match layers.get(&name) {
                    Some(&to) if to > own => {}
                    Some(&to) => wrong.push(format!(
                        "{}:{}: `{module}` (layer {own}) imports `{name}` (layer {to})",
                        file.display(),
                        n + 1
                    )),
                    None => wrong.push(format!(
                        "{}:{}: `crate::{name}` is not a module in the layer list",
                        file.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    assert!(
        seen > 100,
        "only {seen} imports found: the reader is broken"
    );
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_reader_sees_through_comments_strings_and_tests() {
    let text = "use crate::a::B; // crate::up\nlet s = \"crate::up\";\nlet c = '{';\n\
                #[cfg(test)]\nmod tests {\n    use crate::up;\n    fn f() { let x = '}'; }\n}\nuse crate::c;\n";
    let code = code_only(text);
    assert!(code.contains("crate::a::B"));
    assert!(code.contains("crate::c"));
    assert!(!code.contains("crate::up"), "{code}");
    assert_eq!(
        code.lines().count(),
        text.lines().count(),
        "line numbers kept"
    );
}
