//! Builds masq-ebpf's programs for bpfel-unknown-none (nightly, bpf-linker, BTF), straightens
//! their branches (`bpf_straighten`: the common side of a test falls through) and leaves the
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

/// Where in OUT_DIR the object built with the slot table goes (`SLOT_TABLE_OBJECT`); the one
/// without it is OUT_DIR's own `masq`.
const SLOT_TABLE_DIR: &str = "slot-table";

fn build_ebpf() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir).join("../masq-ebpf");
    let ebpf_dir = ebpf_dir.canonicalize()?;
    let root_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    let out_dir = std::env::var("OUT_DIR")?;
    let slot_table_dir = std::path::Path::new(&out_dir).join(SLOT_TABLE_DIR);
    std::fs::create_dir_all(&slot_table_dir)?;
    for (dir, features) in [
        (std::path::PathBuf::from(&out_dir), &[][..]),
        (slot_table_dir, &["slot-table"][..]),
    ] {
        // aya-build leaves the object in OUT_DIR, and builds in a directory under it: each
        // object its own. This script is the process's only thread.
        // SAFETY: no other thread reads the environment meanwhile.
        unsafe { std::env::set_var("OUT_DIR", &dir) };
        aya_build::build_ebpf(
            [aya_build::Package {
                name: "masq-ebpf",
                root_dir,
                features,
                ..Default::default()
            }],
            aya_build::Toolchain::default(),
        )?;
        let object = dir.join("masq");
        let straightened = bpf_straighten::straighten_object(&object)?;
        eprintln!("{}: {straightened} branches straightened", object.display());
    }
    // SAFETY: as above.
    unsafe { std::env::set_var("OUT_DIR", &out_dir) };
    Ok(())
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
