//! Test support: the fields of a C struct in a kernel header, with the offsets they have when
//! laid out without padding, for the tests that hold a `#[repr(C)]` Rust mirror to its header
//! (`FusedLayout`, `GemmProblem`, `RefDims`).

/// The fields of `struct NAME { ... };` in `text`, in order, with their offsets: one field or a
/// comma list per declaration (`u32 m, n, k;`), `u64` or `u32`, `//` comments ignored. Every
/// field must be aligned to its size (the headers assert their sizes; the callers compare the
/// sum with the Rust struct's size, so padding shows).
pub(crate) fn fields(text: &str, name: &str) -> (Vec<(String, usize)>, usize) {
    let body = text
        .split(&format!("struct {name} {{"))
        .nth(1)
        .and_then(|r| r.split("};").next())
        .unwrap_or_else(|| panic!("struct {name} not found"));
    let code: String = body
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(" ");
    let mut at = 0usize;
    let mut out = Vec::new();
    for decl in code.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        let (ty, names) = decl
            .split_once(char::is_whitespace)
            .unwrap_or_else(|| panic!("declaration {decl:?}"));
        let size = match ty {
            "u64" => 8,
            "u32" => 4,
            _ => panic!("field type {ty} in {name}"),
        };
        for n in names.split(',').map(str::trim) {
            assert_eq!(at % size, 0, "{name}.{n} unaligned");
            out.push((n.to_string(), at));
            at += size;
        }
    }
    (out, at)
}

/// The size a header asserts for `name` (`static_assert(sizeof(NAME) == N, ...)`), if it does.
pub(crate) fn asserted_size(text: &str, name: &str) -> Option<usize> {
    text.lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix(&format!("static_assert(sizeof({name}) == "))
        })
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.trim().parse().ok())
}

/// Asserts that the header's `struct NAME` in `text` has the fields `rust` (name, offset, in
/// order; [`rust_offsets`]) and `size` bytes, with no padding, and that the header's size
/// assert, if any, says `size`.
pub(crate) fn assert_mirrors(text: &str, name: &str, rust: Vec<(String, usize)>, size: usize) {
    let (device, at) = fields(text, name);
    assert_eq!(
        at, size,
        "{name}: the device fields span {at} bytes, the Rust struct {size}"
    );
    if let Some(n) = asserted_size(text, name) {
        assert_eq!(n, size, "{name}: the header asserts {n} bytes");
    }
    assert_eq!(device, rust, "{name}: fields and offsets");
}

/// `Vec<(field name, offset)>` of the named fields of a Rust struct `T`, to compare with
/// [`fields`]: `rust_offsets!(T; a, b, c)`.
macro_rules! rust_offsets {
    ($t:ty; $($f:ident),* $(,)?) => {
        vec![$((stringify!($f).to_string(), std::mem::offset_of!($t, $f))),*]
    };
}
pub(crate) use rust_offsets;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comma_lists_comments_and_offsets() {
        let text = "struct s {\n  u64 a;  // x; y\n  u32 b, c;\n  u32 d;  // the end\n};\nstatic_assert(sizeof(s) == 20, \"s\");";
        let (f, at) = fields(text, "s");
        let want: Vec<(String, usize)> = [("a", 0), ("b", 8), ("c", 12), ("d", 16)]
            .iter()
            .map(|&(n, o)| (n.to_string(), o))
            .collect();
        assert_eq!(f, want);
        assert_eq!(at, 20);
        assert_eq!(asserted_size(text, "s"), Some(20));
    }

    #[test]
    #[should_panic(expected = "unaligned")]
    fn an_unaligned_field_is_refused() {
        fields("struct s {\n u32 a;\n u64 b;\n};", "s");
    }
}
