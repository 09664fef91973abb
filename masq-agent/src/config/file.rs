//! One config file: read (bounded), decoded and checked, with the line an error is about.

use std::path::Path;

use ipnet::IpNet;

use super::{
    decode::{CidrList, Field, decode},
    locate::locate,
    model::{
        ConfigError, ConfigOptions, ConfigSource, Explicit, Loaded, MAX_CONFIG_BYTES, Standing,
    },
    tree::read_tree,
    validate::{build_config, check_cidr},
};

pub(super) fn unreadable(origin: &str, e: std::io::Error) -> ConfigError {
    ConfigError::new(origin, None, format!("cannot read the config file: {e}"))
}

/// Reads `path`, but never more than `MAX_CONFIG_BYTES`, even if the file grows meanwhile.
pub(super) fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;

    let file = std::fs::File::open(path)?;
    let mut text = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {} MiB",
            MAX_CONFIG_BYTES >> 20
        )));
    }
    Ok(text)
}

/// Checks config file contents; `origin` names the file in messages.
pub fn parse(text: &[u8], origin: &str, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    parse_with_keys(text, origin, opts, Standing::Alone).map(|(loaded, _)| loaded)
}

/// `parse`, and which keys the file sets.
pub(super) fn parse_with_keys(
    text: &[u8],
    origin: &str,
    opts: &ConfigOptions,
    standing: Standing,
) -> Result<(Loaded, Explicit), ConfigError> {
    let mut warnings = Vec::new();
    let (root, format) = read_tree(text, origin, &mut warnings)?;
    let mut explicit = Explicit::default();
    let checked = decode(&root, format, origin, &mut warnings).and_then(|fields| {
        explicit = Explicit {
            non_masquerade_cidrs: fields.cidrs.is_some(),
            resync_interval: fields.resync_interval.is_some(),
        };
        build_config(&fields, opts, standing, &mut warnings)
    });
    match checked {
        Ok(config) => Ok((
            Loaded {
                config,
                warnings,
                source: ConfigSource::File,
                files: Vec::new(),
            },
            explicit,
        )),
        Err(problem) => {
            let line_of = |anchor| locate(text, &root, format, anchor);
            let line = problem.anchor.and_then(line_of);
            let mut message = problem.message;
            if let Some((what, also)) = problem.also {
                match line_of(also) {
                    Some(n) => message.push_str(&format!("; {what} has it at line {n}")),
                    None => message.push_str(&format!("; {what} has it too")),
                }
            }
            Err(ConfigError::new(origin, line, message))
        }
    }
}

/// The line of the valid config `text` on which `list` holds `net` (as written in any form Go
/// reads as that prefix), where it can be found for sure. Looked for only when asked: an error
/// about two files, or `explain`.
pub fn cidr_line(text: &[u8], opts: &ConfigOptions, list: CidrList, net: IpNet) -> Option<usize> {
    let (root, format) = read_tree(text, "", &mut Vec::new()).ok()?;
    let fields = decode(&root, format, "", &mut Vec::new()).ok()?;
    let items = fields.list(list).clone()?;
    let item = items
        .value
        .into_iter()
        .flatten()
        .find(|item| check_cidr(Some(item), opts).is_ok_and(|n| n == net))?;
    locate(text, &root, format, item)
}

/// The line of the valid config `text` that sets the address key `field`, where it can be found
/// for sure: for an error about two files.
pub(super) fn address_line(text: &[u8], field: Field) -> Option<usize> {
    let (root, format) = read_tree(text, "", &mut Vec::new()).ok()?;
    let fields = decode(&root, format, "", &mut Vec::new()).ok()?;
    locate(text, &root, format, fields.address(field)?.key)
}
