//! The namespace test bed shared by `cargo xtask demo`, the integration tests and the
//! benchmarks: a pod, a forwarding node and an outside server, each in a network namespace the
//! run creates and deletes itself.

pub mod netns;
pub mod packet;
pub mod probe;
pub mod topology;

use std::{
    path::Path,
    time::{Duration, Instant},
};

/// Polls `check` every 50 ms until it returns `Ok(true)`, for at most 10 seconds.
pub fn wait_for(mut check: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if check().unwrap_or(false) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    anyhow::bail!("timed out after 10 s")
}

/// Replaces a file atomically (write, then rename), as a ConfigMap update does.
pub fn write_config(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
