//! Several config files in one directory, merged: a cloud provider's ConfigMap and the user's,
//! projected by kubelet into one volume, as Azure's ip-masq-agent-v2 reads them.
//!
//! Each file is checked on its own, its own `cidrLimit` included (the default list, which
//! applies only when no file sets one, counts toward none), then the files are merged:
//! the CIDR lists joined (an entry a file before already listed is dropped), the booleans ORed,
//! the smallest `resyncInterval`. A directory of one file reads exactly as that file. A prefix
//! that one file exempts and another masquerades is an error naming both files and lines. An
//! error in any file rejects the whole directory, so the last good merged policy stays in force.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use ipnet::IpNet;

use super::{
    decode::{CidrList, Field},
    file::{address_line, cidr_line, parse_with_keys, read_bounded, unreadable},
    model::{Config, ConfigError, ConfigOptions, ConfigSource, Explicit, Loaded, Standing},
    validate::first_in_both,
};

/// Only the files whose names start with this are read: kubelet's `..data` and its timestamped
/// directories, and anything else in the volume, are not config.
pub const FILE_PREFIX: &str = "ip-masq";

/// One file of the directory, read and checked.
struct Part {
    path: PathBuf,
    text: Vec<u8>,
    loaded: Loaded,
    explicit: Explicit,
}

pub(super) fn load(dir: &Path, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    let origin = dir.display().to_string();
    let files = config_files(dir).map_err(|e| unreadable(&origin, e))?;
    if files.is_empty() {
        return Ok(Loaded {
            config: Config::defaults(opts),
            warnings: vec![format!(
                "no file named {FILE_PREFIX}* in the directory {origin}: the defaults apply"
            )],
            source: ConfigSource::Missing,
            files,
        });
    }
    let parts = files
        .into_iter()
        .map(|path| {
            let origin = path.display().to_string();
            let text = read_bounded(&path).map_err(|e| unreadable(&origin, e))?;
            let (loaded, explicit) = parse_with_keys(&text, &origin, opts, Standing::InDirectory)?;
            Ok(Part {
                path,
                text,
                loaded,
                explicit,
            })
        })
        .collect::<Result<Vec<_>, ConfigError>>()?;
    merge(&parts, opts)
}

/// The directory's config files, by name. Symlinks are followed, as kubelet's are symlinks; a
/// subdirectory is not a file, but one that cannot be looked at (a broken link) is kept, so
/// that reading it fails loudly rather than its policy vanishing.
fn config_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(FILE_PREFIX) && !is_leftover(n));
        if named && !path.is_dir() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Copies editors and package managers leave beside a file: an old version is not config.
fn is_leftover(name: &str) -> bool {
    const SUFFIXES: [&str; 8] = [
        "~",
        ".bak",
        ".orig",
        ".swp",
        ".tmp",
        ".dpkg-old",
        ".dpkg-new",
        ".dpkg-dist",
    ];
    SUFFIXES.iter().any(|suffix| name.ends_with(suffix))
}

/// An entry of a list, with the file it came from (`None`: the defaults).
type Entry = (IpNet, Option<usize>);

fn merge(parts: &[Part], opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    let defaults = Config::defaults(opts);
    let joined = |list: fn(&Config) -> &Vec<IpNet>, explicit: fn(&Part) -> bool| {
        let mut seen = HashSet::new();
        let mut entries: Vec<Entry> = Vec::new();
        for (i, part) in parts.iter().enumerate().filter(|(_, p)| explicit(p)) {
            let fresh: Vec<IpNet> = list(&part.loaded.config)
                .iter()
                .filter(|net| !seen.contains(*net))
                .copied()
                .collect();
            seen.extend(fresh.iter().copied());
            entries.extend(fresh.into_iter().map(|net| (net, Some(i))));
        }
        entries
    };
    let mut non_masq = joined(
        |c| &c.non_masquerade_cidrs,
        |p| p.explicit.non_masquerade_cidrs,
    );
    if non_masq.is_empty() && !parts.iter().any(|p| p.explicit.non_masquerade_cidrs) {
        non_masq = defaults
            .non_masquerade_cidrs
            .iter()
            .map(|net| (*net, None))
            .collect();
    }
    let masq = joined(|c| &c.masquerade_cidrs, |_| true);
    check_no_prefix_in_two_lists(parts, (&non_masq, &masq), CidrList::NonMasquerade, opts)?;
    let non_masq_src = joined(|c| &c.non_masquerade_src_cidrs, |_| true);
    let masq_src = joined(|c| &c.masquerade_src_cidrs, |_| true);
    check_no_prefix_in_two_lists(
        parts,
        (&non_masq_src, &masq_src),
        CidrList::NonMasqueradeSrc,
        opts,
    )?;
    let nets = |entries: Vec<Entry>| entries.into_iter().map(|(net, _)| net).collect();

    let configs = || parts.iter().map(|p| &p.loaded.config);
    let config = Config {
        non_masquerade_cidrs: nets(non_masq),
        masquerade_cidrs: nets(masq),
        non_masquerade_src_cidrs: nets(non_masq_src),
        masquerade_src_cidrs: nets(masq_src),
        masquerade_address: one_address(parts, Field::MasqAddress, |c| c.masquerade_address)?,
        masquerade_address_ipv6: one_address(parts, Field::MasqAddressIpv6, |c| {
            c.masquerade_address_ipv6
        })?,
        cidr_limit: configs()
            .map(|c| c.cidr_limit)
            .max()
            .unwrap_or(defaults.cidr_limit),
        masq_link_local: configs().any(|c| c.masq_link_local),
        masq_link_local_ipv6: configs().any(|c| c.masq_link_local_ipv6),
        resync_interval: parts
            .iter()
            .filter(|p| p.explicit.resync_interval)
            .map(|p| p.loaded.config.resync_interval)
            .min()
            .unwrap_or(defaults.resync_interval),
        // ORed, as the other booleans, among the files that set it.
        enable_ipv6: configs()
            .filter_map(|c| c.enable_ipv6)
            .reduce(|a, b| a || b),
    };
    Ok(Loaded {
        config,
        warnings: parts
            .iter()
            .flat_map(|p| p.loaded.warnings.iter().cloned())
            .collect(),
        source: ConfigSource::Directory,
        files: parts.iter().map(|p| p.path.clone()).collect(),
    })
}

/// The address the files set with the address key `field`, which they may set alike or leave
/// out: masqueraded traffic takes one address, and two files that name two are an error on
/// the later one's line, naming where the other sets it.
fn one_address<T: PartialEq + Copy + std::fmt::Display>(
    parts: &[Part],
    field: Field,
    of: impl Fn(&Config) -> Option<T>,
) -> Result<Option<T>, ConfigError> {
    let mut found: Option<(T, &Part)> = None;
    for part in parts {
        let Some(value) = of(&part.loaded.config) else {
            continue;
        };
        match found {
            Some((first, other)) if first != value => {
                let line = |part: &Part| address_line(&part.text, field);
                let at = line(other).map_or(String::new(), |n| format!(" at line {n}"));
                return Err(ConfigError::new(
                    &part.path.display().to_string(),
                    line(part),
                    format!(
                        "{} is {value} here and {first} in {}{at}: masqueraded traffic takes \
                         one address",
                        field.name(),
                        other.path.display()
                    ),
                ));
            }
            Some(_) => {}
            None => found = Some((value, part)),
        }
    }
    Ok(found.map(|(value, _)| value))
}

/// A prefix one file exempts and another masquerades decides nothing: an error on the
/// exception's line, naming where the other file has it. `non_masq_list` names the pair of
/// lists (destinations or sources) by its non-masquerade list.
fn check_no_prefix_in_two_lists(
    parts: &[Part],
    (non_masq, masq): (&[Entry], &[Entry]),
    non_masq_list: CidrList,
    opts: &ConfigOptions,
) -> Result<(), ConfigError> {
    let Some((net, in_part, other_part)) = first_in_both(non_masq, masq) else {
        return Ok(());
    };
    let place = |part: Option<usize>, list: CidrList| -> (String, Option<usize>) {
        match part.map(|i| &parts[i]) {
            Some(p) => (
                p.path.display().to_string(),
                cidr_line(&p.text, opts, list, *net),
            ),
            None => ("the defaults".into(), None),
        }
    };
    let masq_list = non_masq_list.exceptions();
    let (origin, line) = place(*in_part, masq_list);
    let (other, other_line) = place(*other_part, non_masq_list);
    let at = other_line.map_or(String::new(), |n| format!(" at line {n}"));
    Err(ConfigError::new(
        &origin,
        line,
        format!(
            "CIDR \"{net}\" is in {} here and in {} in {other}{at}: \
             a {} is either masqueraded or not",
            masq_list.key(),
            non_masq_list.key(),
            non_masq_list.holds()
        ),
    ))
}
