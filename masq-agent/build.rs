//! Builds masq-ebpf's programs for bpfel-unknown-none (nightly, bpf-linker, BTF) and leaves the
//! object in OUT_DIR, where `src/dataplane/ebpf` embeds it.

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir).join("../masq-ebpf");
    let ebpf_dir = ebpf_dir.canonicalize()?;
    let root_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "masq-ebpf",
            root_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
