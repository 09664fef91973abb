//! The namespace test bed shared by `cargo xtask demo`, the integration tests and the
//! benchmarks: a pod, a forwarding node and an outside server, each in a network namespace the
//! run creates and deletes itself.

pub mod load;
pub mod netns;
pub mod packet;
pub mod prefixes;
pub mod probe;
pub mod topology;
pub mod workers;

use std::{
    path::Path,
    time::{Duration, Instant},
};

/// Polls `check` every 50 ms until it returns `Ok(true)`, for at most 10 seconds.
pub fn wait_for(check: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    wait_for_long(Duration::from_secs(10), check)
}

/// Polls `check` until it returns `Ok(true)`, for at most `limit`; every 2 ms at first, so that
/// short waits are measured finely, then every 50 ms.
pub fn wait_for_long(
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().unwrap_or(false) {
            return Ok(());
        }
        let pause = if started.elapsed() < Duration::from_secs(1) {
            2
        } else {
            50
        };
        std::thread::sleep(Duration::from_millis(pause));
    }
    anyhow::bail!("timed out after {limit:?}")
}

/// Replaces a file atomically (write, then rename), as a ConfigMap update does.
pub fn write_config(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
