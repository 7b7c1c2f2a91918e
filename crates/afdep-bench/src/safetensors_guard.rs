//! A check of a safetensors file's data offsets before the `safetensors` crate parses it:
//! version 0.4 adds the largest end offset to the header length without overflow checks (a
//! panic in debug builds, a wrapped sum in release builds) when a header names offsets near
//! `u64::MAX`. The fuzz tests found it (the `fuzz_inputs` tests); this refuses such files with a
//! clear error first.

use anyhow::{Result, bail};

/// Fails when a tensor of the file's header (if the header parses at all: the crate reports
/// the other defects) has a data offset beyond the file's data.
pub fn check_offsets(buf: &[u8]) -> Result<()> {
    let Some(len) = buf.get(..8) else {
        return Ok(());
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    let Some(header) = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .and_then(|end| buf.get(8..end))
    else {
        return Ok(());
    };
    let data = (buf.len() - 8 - header.len()) as u64;
    let Ok(serde_json::Value::Object(entries)) = serde_json::from_slice(header) else {
        return Ok(());
    };
    for (name, t) in &entries {
        if name == "__metadata__" {
            continue;
        }
        let Some(offsets) = t.get("data_offsets").and_then(|o| o.as_array()) else {
            continue;
        };
        for o in offsets {
            if let Some(v) = o.as_u64() {
                if v > data {
                    bail!(
                        "tensor `{name}`: data offset {v} is beyond the file's {data} data bytes"
                    );
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend(std::iter::repeat_n(0u8, data));
        b
    }

    #[test]
    fn offsets_beyond_the_data_are_refused() {
        let ok = file(
            r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            4,
        );
        check_offsets(&ok).unwrap();
        let bad = file(
            r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[0,18446744073709551615]}}"#,
            4,
        );
        let e = check_offsets(&bad).unwrap_err().to_string();
        assert!(
            e.contains("`x`") && e.contains("18446744073709551615"),
            "{e}"
        );
        // what does not parse is left to the crate
        check_offsets(b"").unwrap();
        check_offsets(&file("{not json", 0)).unwrap();
        check_offsets(&[255; 8]).unwrap();
    }
}
