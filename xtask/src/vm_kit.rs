//! The VM step's kit: virtme-ng and virtiofsd, installed where missing, and the kernels it
//! boots (`Flavour`), from Debian's security archive, checked against its index's SHA-256,
//! unpacked with `dpkg-deb -x` (never installed into /boot), and kept in a cache directory
//! across runs.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

/// virtme-ng, which boots a kernel on a copy-on-write view of this machine's root.
const VIRTME_NG: &str = "virtme-ng==1.42";
/// The cloud kernel has no 9p: the root is shared over virtio-fs, served by this.
const VIRTIOFSD_VERSION: &str = "1.14.0";
/// A kernel the step boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    /// Debian 12's 6.1, as most nodes of that generation run it.
    Generic61,
    /// Debian 12's 6.1 for cloud VMs: other drivers and options (no 9p), the same verifier.
    Cloud61,
    /// Debian 11's 5.10, the generation of Amazon Linux 2 nodes: no coarse clock, no TCX, map
    /// memory charged to RLIMIT_MEMLOCK.
    Generic510,
}

/// An archive's package index, and the base its files' paths are relative to.
struct Archive {
    index: &'static str,
    pool: &'static str,
}

const BOOKWORM_SECURITY: Archive = Archive {
    index: "http://deb.debian.org/debian-security/dists/bookworm-security/main/binary-amd64/Packages.xz",
    pool: "http://deb.debian.org/debian-security",
};
const BULLSEYE_SECURITY: Archive = Archive {
    index: "http://deb.debian.org/debian-security/dists/bullseye-security/main/binary-amd64/Packages.xz",
    pool: "http://deb.debian.org/debian-security",
};

impl Flavour {
    pub const ALL: [Flavour; 3] = [Flavour::Generic61, Flavour::Cloud61, Flavour::Generic510];

    /// Whether its kernel has BPF atomics on map values (5.12), which the slot table needs.
    pub fn has_bpf_atomics(self) -> bool {
        match self {
            Flavour::Generic61 | Flavour::Cloud61 => true,
            Flavour::Generic510 => false,
        }
    }

    fn archive(self) -> &'static Archive {
        match self {
            Flavour::Generic61 | Flavour::Cloud61 => &BOOKWORM_SECURITY,
            Flavour::Generic510 => &BULLSEYE_SECURITY,
        }
    }

    /// The release up to the ABI number, and after it: `6.1.0-` `N` `-amd64`.
    fn release_parts(self) -> (&'static str, &'static str) {
        match self {
            Flavour::Generic61 => ("6.1.0-", "-amd64"),
            Flavour::Cloud61 => ("6.1.0-", "-cloud-amd64"),
            Flavour::Generic510 => ("5.10.0-", "-amd64"),
        }
    }

    fn release(self, abi: u32) -> String {
        let (before, after) = self.release_parts();
        format!("{before}{abi}{after}")
    }

    fn package(self, abi: u32) -> String {
        format!("linux-image-{}-unsigned", self.release(abi))
    }

    /// The ABI number of `package` if it is this flavour's kernel image.
    fn abi_of(self, package: &str) -> Option<u32> {
        let (before, after) = self.release_parts();
        package
            .strip_prefix("linux-image-")?
            .strip_suffix("-unsigned")?
            .strip_prefix(before)?
            .strip_suffix(after)?
            .parse()
            .ok()
    }
}

/// The cache of unpacked kernels and of virtme-ng's environment, kept across runs and
/// checkouts.
pub fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("masq-agent")
}

/// virtme-ng's venv's bin directory.
pub fn venv_bin() -> PathBuf {
    cache_dir().join("virtme-ng/bin")
}

pub fn vng() -> PathBuf {
    venv_bin().join("vng")
}

pub fn cargo_bin() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_default()
        .join("bin")
}

/// Installs what the VM step needs, where missing: virtme-ng in a venv of its own, virtiofsd,
/// and the kernels. The Debian packages (qemu, kmod, busybox) come with the others.
pub fn setup() -> anyhow::Result<()> {
    if !vng().exists() {
        let venv = cache_dir().join("virtme-ng");
        eprintln!("xtask: setup: installing {VIRTME_NG} in {}", venv.display());
        crate::step("python3", &["-m", "venv", &venv.to_string_lossy()])?;
        let pip = venv.join("bin/pip");
        crate::step(
            &pip.to_string_lossy(),
            &[
                "install",
                "--quiet",
                "--disable-pip-version-check",
                VIRTME_NG,
            ],
        )?;
    }
    let installed = Command::new(cargo_bin().join("virtiofsd"))
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(VIRTIOFSD_VERSION));
    if !installed {
        eprintln!("xtask: setup: building virtiofsd {VIRTIOFSD_VERSION} (about two minutes)");
        crate::step(
            "cargo",
            &[
                "install",
                "--quiet",
                "--locked",
                "virtiofsd",
                "--version",
                VIRTIOFSD_VERSION,
            ],
        )?;
    }
    for flavour in Flavour::ALL {
        kernel(flavour)?;
    }
    eprintln!("xtask: setup: virtme-ng, virtiofsd and the VMs' kernels present");
    Ok(())
}

/// A kernel unpacked in the cache: its image and its release (`uname -r`).
pub struct Kernel {
    pub vmlinuz: PathBuf,
    pub release: String,
}

/// The flavour's kernel, unpacked in the cache: the one already there, or the newest the
/// archive has, downloaded and checked.
pub fn kernel(flavour: Flavour) -> anyhow::Result<Kernel> {
    let dir = cache_dir().join("kernels");
    if let Some(kernel) = cached_kernel(&dir, flavour) {
        return Ok(kernel);
    }
    let (package, url, sha256) = newest_package(flavour)?;
    std::fs::create_dir_all(&dir)?;
    eprintln!("xtask: setup: downloading {package}");
    let deb = dir.join(format!("{package}.deb"));
    crate::step(
        "curl",
        &[
            "--fail",
            "--silent",
            "--show-error",
            "--output",
            &deb.to_string_lossy(),
            &url,
        ],
    )?;
    if crate::install_kit::sha256(&deb)? != sha256 {
        let _ = std::fs::remove_file(&deb);
        bail!("{url}: its SHA-256 is not the archive index's ({sha256})");
    }
    let unpacking = dir.join(format!("{package}.partial"));
    let _ = std::fs::remove_dir_all(&unpacking);
    crate::step(
        "dpkg-deb",
        &["-x", &deb.to_string_lossy(), &unpacking.to_string_lossy()],
    )?;
    std::fs::rename(&unpacking, dir.join(&package))?;
    let _ = std::fs::remove_file(&deb);
    cached_kernel(&dir, flavour).with_context(|| format!("{package} holds no kernel image"))
}

fn cached_kernel(dir: &Path, flavour: Flavour) -> Option<Kernel> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let abi = flavour.abi_of(&entry.file_name().to_string_lossy())?;
            Some((abi, entry.path()))
        })
        .collect();
    found.sort();
    let (abi, path) = found.pop()?;
    let release = flavour.release(abi);
    let vmlinuz = path.join(format!("boot/vmlinuz-{release}"));
    vmlinuz.exists().then_some(Kernel { vmlinuz, release })
}

/// The newest of the flavour's kernel packages in its archive's index: its name, where to
/// download it, and its SHA-256.
fn newest_package(flavour: Flavour) -> anyhow::Result<(String, String, String)> {
    let archive = flavour.archive();
    let index = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "curl --fail --silent --show-error {} | xz --decompress --stdout",
            archive.index
        ))
        .output()
        .context("reading the archive's package index")?;
    if !index.status.success() {
        bail!(
            "reading {} failed: {}",
            archive.index,
            String::from_utf8_lossy(&index.stderr)
        );
    }
    let text = String::from_utf8_lossy(&index.stdout);
    let mut best: Option<(u32, String, String)> = None;
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
                .map(str::to_string)
        };
        let (Some(package), Some(file), Some(sha256)) =
            (field("Package"), field("Filename"), field("SHA256"))
        else {
            continue;
        };
        if let Some(abi) = flavour.abi_of(&package)
            && best.as_ref().is_none_or(|(b, _, _)| abi > *b)
        {
            best = Some((abi, file, sha256));
        }
    }
    let (abi, file, sha256) = best.with_context(|| {
        format!(
            "{} lists no {} kernel",
            archive.index,
            flavour.package(0).replace("-0-", "-N-")
        )
    })?;
    Ok((
        flavour.package(abi),
        format!("{}/{file}", archive.pool),
        sha256,
    ))
}
