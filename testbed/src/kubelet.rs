//! A ConfigMap volume as kubelet lays it out and updates it, for the tests and the benchmark:
//!
//! ```text
//! <dir>/..2026_11_30_01_02_03.000000001/<key>   the contents, one directory per version
//! <dir>/..data -> ..2026_11_30_01_02_03.000000001
//! <dir>/<key> -> ..data/<key>                   what the container reads
//! ```
//!
//! An update writes a new version directory, points a `..data_tmp` symlink at it, renames that
//! over `..data` (the one atomic step) and then removes the old version. The file a container
//! reads is never written in place, so a watcher on the file itself sees nothing.

use std::{
    os::unix::fs::symlink,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

pub struct ConfigMapVolume {
    dir: PathBuf,
    key: String,
    version: u32,
}

impl ConfigMapVolume {
    /// Projects `text` under `key` into `dir`, which is created.
    pub fn create(dir: &Path, key: &str, text: &str) -> anyhow::Result<ConfigMapVolume> {
        std::fs::create_dir_all(dir)?;
        let mut volume = ConfigMapVolume {
            dir: dir.to_path_buf(),
            key: key.to_string(),
            version: 0,
        };
        volume.publish(text)?;
        symlink(format!("..data/{key}"), volume.file())?;
        Ok(volume)
    }

    /// The directory kubelet mounts into the container.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path a container reads: `<dir>/<key>`.
    pub fn file(&self) -> PathBuf {
        self.dir.join(&self.key)
    }

    /// Replaces the contents the way kubelet does.
    pub fn update(&mut self, text: &str) -> anyhow::Result<()> {
        let old = self.version_dir(self.version);
        self.publish(text)?;
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))
    }

    fn publish(&mut self, text: &str) -> anyhow::Result<()> {
        self.version += 1;
        let version = self.version_dir(self.version);
        std::fs::create_dir(&version)?;
        std::fs::write(version.join(&self.key), text)?;
        let tmp = self.dir.join("..data_tmp");
        symlink(version.file_name().context("version name")?, &tmp)?;
        std::fs::rename(&tmp, self.dir.join("..data"))?;
        Ok(())
    }

    /// Kubelet names versions after the time of the update; a counter in the fraction keeps
    /// them unique and ordered here.
    fn version_dir(&self, version: u32) -> PathBuf {
        self.dir.join(format!("..2026_11_30_01_02_03.{version:09}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn lays_out_and_swaps_like_kubelet() {
        let dir = std::env::temp_dir().join(format!("kubelet-volume-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut volume = ConfigMapVolume::create(&dir, "config", "one").unwrap();
        let version = ["..2026_11_30_01_02_03.000000001", "..data", "config"];
        assert_eq!(entries(&dir), version);
        assert_eq!(
            std::fs::read_link(volume.file()).unwrap(),
            Path::new("..data/config")
        );
        assert_eq!(
            std::fs::read_link(dir.join("..data")).unwrap(),
            Path::new(version[0])
        );
        assert_eq!(std::fs::read_to_string(volume.file()).unwrap(), "one");

        volume.update("two").unwrap();
        assert_eq!(std::fs::read_to_string(volume.file()).unwrap(), "two");
        assert_eq!(
            entries(&dir),
            ["..2026_11_30_01_02_03.000000002", "..data", "config"],
            "the old version is gone, and so is ..data_tmp"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
