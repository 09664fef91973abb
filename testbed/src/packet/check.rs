//! Comparing what came out of a program with what should have.

use super::segment::{same_checksum, word};

use std::ops::Range;

/// The byte offsets at which two frames of one length differ.
pub fn diff(a: &[u8], b: &[u8]) -> Vec<usize> {
    assert_eq!(a.len(), b.len(), "frame length changed");
    (0..a.len()).filter(|&i| a[i] != b[i]).collect()
}

/// `len` bytes from `at`.
pub fn range(at: usize, len: usize) -> Range<usize> {
    at..at + len
}

/// Every byte that differs between `input` and `out` lies in `allowed`.
pub fn assert_changed_within(input: &[u8], out: &[u8], allowed: &[Range<usize>]) {
    for i in diff(input, out) {
        assert!(
            allowed.iter().any(|r| r.contains(&i)),
            "byte {i} changed ({:#04x} -> {:#04x}), outside {allowed:?}",
            input[i],
            out[i]
        );
    }
}

/// `out` is `expected` byte for byte, except that the 16-bit checksum fields at `csums` may
/// hold either form of one's-complement zero.
pub fn assert_frame(out: &[u8], expected: &[u8], csums: &[usize]) {
    assert_eq!(out.len(), expected.len(), "frame length");
    let wrong: Vec<usize> = (0..out.len())
        .filter(|&i| !csums.iter().any(|&c| (c..c + 2).contains(&i)) && out[i] != expected[i])
        .collect();
    assert!(
        wrong.is_empty(),
        "bytes {wrong:?} differ from the expected frame\n     got: {out:02x?}\nexpected: {expected:02x?}"
    );
    for &c in csums {
        assert!(
            same_checksum(word(out, c), word(expected, c)),
            "checksum at {c}: {:#06x}, expected {:#06x}",
            word(out, c),
            word(expected, c)
        );
    }
}
