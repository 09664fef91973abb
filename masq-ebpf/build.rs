//! Link settings for the tc programs.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("bpf") {
        // bpf-linker asks LLVM by default to expand memcpy in order, for JITs that pattern-match
        // copies; none of the kernels this runs on does, and the same setting turns every zeroed
        // struct into a call to a byte-by-byte `memset`: a call per packet, and a stack frame
        // that kernels before 6.6 round up to 32 bytes in the verifier's 512-byte budget.
        println!("cargo:rustc-link-arg-bins=--disable-expand-memcpy-in-order");
    }
}
