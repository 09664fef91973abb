//! `helm` and `kubectl`, which render and check deploy/: the ones on PATH where there are, else
//! the pinned builds `cargo xtask setup` installs under target/tools/bin.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

/// One of the Kubernetes tools the checks of deploy/ run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubeTool {
    Helm,
    Kubectl,
}

impl KubeTool {
    pub const ALL: [KubeTool; 2] = [KubeTool::Helm, KubeTool::Kubectl];

    /// The program's name, on PATH and in the tools directory.
    pub fn name(self) -> &'static str {
        match self {
            KubeTool::Helm => "helm",
            KubeTool::Kubectl => "kubectl",
        }
    }

    /// The one on PATH, if there is one.
    pub fn on_path(self) -> Option<PathBuf> {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .map(|dir| dir.join(self.name()))
            .find(|candidate| is_executable(candidate))
    }

    /// Where `cargo xtask setup` installs it when PATH has none.
    pub fn installed_path(self) -> PathBuf {
        tools_dir().join(self.name())
    }

    /// The program to run: the one on PATH, else the installed one.
    pub fn path(self) -> anyhow::Result<PathBuf> {
        if let Some(found) = self.on_path() {
            return Ok(found);
        }
        let installed = self.installed_path();
        if is_executable(&installed) {
            return Ok(installed);
        }
        bail!(
            "{} is neither on PATH nor in {}: `cargo xtask setup` installs it",
            self.name(),
            tools_dir().display()
        )
    }

    /// Runs it with `args`; its standard output, or an error that holds what it printed.
    pub fn run(self, args: &[&str]) -> anyhow::Result<String> {
        let program = self.path()?;
        let program = program.to_str().context("the tool's path is not UTF-8")?;
        crate::netns::run(program, args)
    }
}

/// The directory `cargo xtask setup` installs the tools into.
pub fn tools_dir() -> PathBuf {
    crate::workspace_root().join("target/tools/bin")
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
