//! Builds masq-ebpf's programs for bpfel-unknown-none (nightly, bpf-linker, BTF) and leaves the
//! object in OUT_DIR, where `src/dataplane/ebpf` embeds it.
//!
//! aya-build passes on every line of the nested cargo build as a `cargo:warning`, which cargo
//! shows as about fifty warnings on a fresh build, read by newcomers as problems. Those lines go
//! to this script's stderr instead, which cargo shows only when the script fails.

use std::io::Write as _;

/// What aya-build prints for each line of the nested build's output.
const NESTED_OUTPUT: &str = "cargo:warning=";

fn main() -> anyhow::Result<()> {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let capture = out_dir.join("ebpf-build.log");
    let built = with_stdout_in(&capture, build_ebpf)?;
    for line in std::fs::read_to_string(&capture)?.lines() {
        match line.strip_prefix(NESTED_OUTPUT) {
            Some(nested) => eprintln!("{nested}"),
            // The rerun-if instructions, which cargo needs.
            None => println!("{line}"),
        }
    }
    built
}

fn build_ebpf() -> anyhow::Result<()> {
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

/// Runs `f` with this process's standard output going to the file `path`: aya-build prints
/// straight to it, so its lines can be held back only below the Rust level.
fn with_stdout_in<T>(path: &std::path::Path, f: impl FnOnce() -> T) -> anyhow::Result<T> {
    let file = std::fs::File::create(path)?;
    let cargos = nix::unistd::dup(std::io::stdout())?;
    std::io::stdout().flush()?;
    nix::unistd::dup2_stdout(&file)?;
    let result = f();
    std::io::stdout().flush()?;
    nix::unistd::dup2_stdout(&cargos)?;
    Ok(result)
}
