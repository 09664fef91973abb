//! The agent's objects on bpffs: where they live, and whether what an earlier agent left there
//! can be reused. A map whose layout differs (an older version, another capacity) is replaced,
//! never misread.

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use aya::maps::{Map, MapData, MapError, MapType};
use tracing::{info, warn};

use super::{
    flow_table::{NatTable, Table, TableMaps},
    hook::Hook,
    map_types,
};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Where everything is pinned: `<bpffs>/<map name>` and `<bpffs>/links/<device>-<hook>`.
#[derive(Debug, Clone)]
pub struct Pins {
    pub dir: PathBuf,
}

impl Pins {
    pub fn new(dir: &Path) -> Pins {
        Pins {
            dir: dir.to_path_buf(),
        }
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The map pinned as `name`, as it is.
    pub fn open_map(&self, name: &str) -> anyhow::Result<Map> {
        let data = MapData::from_pin(self.map(name))
            .with_context(|| format!("opening pinned map {name}"))?;
        Map::from_map_data(data).with_context(|| format!("pinned map {name}"))
    }

    /// The map pinned as `name`, typed as the agent reads it.
    pub fn open<M: TryFrom<Map, Error = MapError>>(&self, name: &str) -> anyhow::Result<M> {
        map_types::typed(self.open_map(name)?, name)
    }

    /// The family's NAT table pinned under these pins, in its `maps`; `None` where none is (an
    /// agent from before IPv6 pinned no `nat_v6`). An agent from before the slot table pinned
    /// only the hash table.
    pub fn nat_table<A>(&self, maps: &TableMaps) -> anyhow::Result<Option<NatTable<A>>>
    where
        A: masq_ebpf::Address,
        masq_ebpf::NatKey<A>: aya::Pod,
        masq_ebpf::NatEntry<A>: aya::Pod,
    {
        if !self.map(maps.hash).exists() {
            return Ok(None);
        }
        let slot_table = match self.map(maps.words).exists() && self.map(maps.slots).exists() {
            true => Some((self.open_map(maps.slots)?, self.open_map(maps.words)?)),
            false => None,
        };
        NatTable::from_maps(self.open_map(maps.hash)?, slot_table)
            .with_context(|| format!("the NAT table pinned as {}", maps.hash))
            .map(Some)
    }

    /// The seed of the family's slot table pinned here in its `maps`, if one is.
    pub fn slot_seed<A>(&self, maps: &TableMaps) -> anyhow::Result<Option<u64>>
    where
        A: masq_ebpf::Address,
        masq_ebpf::NatKey<A>: aya::Pod,
        masq_ebpf::NatEntry<A>: aya::Pod,
    {
        let Some(table) = self.nat_table::<A>(maps)? else {
            return Ok(None);
        };
        table.slot_seed().map(Some)
    }

    /// Every half of the family's NAT table pinned in its `maps`; none where no table is.
    pub fn nat_halves<A>(&self, maps: &TableMaps) -> anyhow::Result<Table<A>>
    where
        A: masq_ebpf::Address,
        masq_ebpf::NatKey<A>: aya::Pod,
        masq_ebpf::NatEntry<A>: aya::Pod,
    {
        self.nat_table::<A>(maps)?
            .map_or(Ok(Vec::new()), |table| table.read_all())
    }

    pub fn links_dir(&self) -> PathBuf {
        self.dir.join("links")
    }

    pub fn link(&self, device: &str, hook: &str) -> PathBuf {
        self.links_dir().join(format!("{device}-{hook}"))
    }

    /// Every pinned link: its device, hook and path.
    pub fn links(&self) -> Vec<(String, Hook, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(self.links_dir()) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let (device, hook) = name.rsplit_once('-')?;
                let hook = Hook::BOTH.into_iter().find(|h| h.name() == hook)?;
                Some((device.to_string(), hook, entry.path()))
            })
            .collect()
    }

    /// The devices with a pinned link, once each.
    pub fn linked_devices(&self) -> Vec<String> {
        let mut devices: Vec<String> = self.links().into_iter().map(|(d, _, _)| d).collect();
        devices.sort();
        devices.dedup();
        devices
    }

    /// What is pinned now, to tell later what an attempt added or replaced.
    pub fn snapshot(&self) -> PinnedBefore {
        PinnedBefore {
            dir: self.dir.exists(),
            entries: std::fs::read_dir(&self.dir)
                .map(|entries| {
                    entries
                        .flatten()
                        .filter_map(|e| Some((e.file_name(), e.metadata().ok()?.ino())))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Removes what was pinned since `before`, new names and new objects under old names
    /// alike; the directory itself if it was not there.
    pub fn remove_pinned_since(&self, before: &PinnedBefore) {
        let removed = if before.dir {
            std::fs::read_dir(&self.dir).map(|entries| {
                for entry in entries.flatten() {
                    let inode = entry.metadata().map(|m| m.ino()).ok();
                    if inode.is_some() && before.entries.get(&entry.file_name()) == inode.as_ref() {
                        continue;
                    }
                    let path = entry.path();
                    let _ = if path.is_dir() {
                        std::fs::remove_dir_all(&path)
                    } else {
                        std::fs::remove_file(&path)
                    };
                }
            })
        } else {
            std::fs::remove_dir_all(&self.dir)
        };
        if let Err(err) = removed
            && err.kind() != std::io::ErrorKind::NotFound
        {
            warn!(dir = %self.dir.display(), "could not remove what a failed load pinned: {err}");
        }
    }

    /// Makes sure the directory exists on a BPF filesystem, mounting one at the parent if none
    /// is there (as on a node where nothing has mounted /sys/fs/bpf yet).
    pub fn prepare(&self) -> anyhow::Result<()> {
        let parent = self
            .dir
            .parent()
            .context("--bpffs must name a directory under a BPF filesystem")?;
        if !is_bpffs(parent) {
            std::fs::create_dir_all(parent).with_context(|| {
                format!(
                    "{} is not on a BPF filesystem, and creating it to mount one failed",
                    parent.display()
                )
            })?;
            nix::mount::mount(
                Some("bpf"),
                parent,
                Some("bpf"),
                nix::mount::MsFlags::empty(),
                None::<&str>,
            )
            .with_context(|| {
                format!(
                    "{} is not on a BPF filesystem, and mounting one there failed",
                    parent.display()
                )
            })?;
            info!(path = %parent.display(), "mounted a BPF filesystem");
        }
        std::fs::create_dir_all(self.links_dir())
            .with_context(|| format!("creating {}", self.links_dir().display()))?;
        if !is_bpffs(&self.dir) {
            bail!("{} is not on a BPF filesystem", self.dir.display());
        }
        Ok(())
    }

    /// Removes pinned maps whose type or layout differs from `expected` (what this build
    /// creates), so that the loader creates fresh ones. Returns the names it replaced.
    pub fn discard_incompatible(&self, expected: &[MapSpec]) -> Vec<&'static str> {
        let mut replaced = Vec::new();
        for spec in expected {
            let path = self.map(spec.name);
            if !path.exists() {
                continue;
            }
            let verdict = MapData::from_pin(&path)
                .map_err(anyhow::Error::from)
                .and_then(|m| Ok(m.info()?))
                .and_then(|info| {
                    let found = (
                        info.map_type()?,
                        info.key_size(),
                        info.value_size(),
                        info.max_entries(),
                    );
                    let want = (spec.kind, spec.key_size, spec.value_size, spec.max_entries);
                    Ok((found == want)
                        .then_some(())
                        .ok_or(format!("{found:?}, want {want:?}")))
                });
            let why = match verdict {
                Ok(Ok(())) => continue,
                Ok(Err(diff)) => diff,
                Err(err) => format!("unreadable: {err:#}"),
            };
            warn!(
                map = spec.name,
                "replacing a pinned map with an incompatible layout: {why}"
            );
            if let Err(err) = std::fs::remove_file(&path) {
                warn!(path = %path.display(), "could not remove: {err}");
            }
            replaced.push(spec.name);
        }
        replaced
    }
}

/// What was pinned before an attempt to load (`Pins::snapshot`): each name's inode, which a
/// new object pinned under the same name does not share.
pub struct PinnedBefore {
    dir: bool,
    entries: std::collections::BTreeMap<std::ffi::OsString, u64>,
}

fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
}

/// A map as the kernel reports it: what a pinned map must match to be reused.
#[derive(Debug)]
pub struct MapSpec {
    pub name: &'static str,
    pub kind: MapType,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}
