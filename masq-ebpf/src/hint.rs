//! Which way a branch mostly goes, for the compiler's layout of the code. End to end a program
//! runs with the CPU's branch predictors cold (docs/bench/profiles.md, "A run end to end,
//! cold"), and a predictor that knows nothing of a branch takes it as not taken: every branch
//! the common path takes costs it a pipeline thrown away. Marking the rare side of a test lets
//! LLVM lay the common side out right behind it. LLVM's BPF backend cannot invert a test, and so
//! leaves it jumping over a `goto` to the common side; `bpf-straighten` inverts it after the
//! link, so that the common side falls through.

pub use core::hint::cold_path;

/// `condition`, which mostly holds.
#[inline(always)]
pub fn likely(condition: bool) -> bool {
    if !condition {
        cold_path();
    }
    condition
}

/// `condition`, which mostly does not hold.
#[inline(always)]
pub fn unlikely(condition: bool) -> bool {
    if condition {
        cold_path();
    }
    condition
}

/// `result`, which is mostly `Ok`: a kernel helper's, whose errors (a packet shorter than it
/// said, a map's slot out of range) no well-formed packet meets.
#[inline(always)]
pub fn rarely_failing<T, E>(result: Result<T, E>) -> Result<T, E> {
    if result.is_err() {
        cold_path();
    }
    result
}
