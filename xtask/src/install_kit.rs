//! What the installers share: a Python venv for tools that ship as wheels, and the checksum
//! that every download is held to. Below both `setup` and the installers it calls.

use anyhow::Context as _;

use masq_testbed::netns;

use crate::step;

/// The Python venv under target/ that the Python tools are installed into, made first if it is
/// missing.
pub fn python_venv() -> anyhow::Result<std::path::PathBuf> {
    let venv = masq_testbed::workspace_root().join("target/venv");
    if !venv.join("bin/pip").exists() {
        // Debian's interpreter, whose venv module comes with python3-venv.
        step(
            "/usr/bin/python3",
            &["-m", "venv", venv.to_str().context("venv path")?],
        )?;
    }
    Ok(venv)
}

/// The SHA-256 of a file, in hex, as `sha256sum` computes it.
pub fn sha256(path: &std::path::Path) -> anyhow::Result<String> {
    let path = path.to_str().context("a path that is not UTF-8")?;
    let out = netns::run("sha256sum", &[path])?;
    Ok(out
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}
