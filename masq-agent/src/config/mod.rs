//! The agent's config file, read the way the upstream ip-masq-agent (Go) reads it, so that an
//! existing ConfigMap keeps its meaning.
//!
//! Upstream turns the file into JSON (YAML 1.1 rules, go-yaml v2) and decodes that with Go's
//! encoding/json. We don't go through JSON text: both formats are read into a small [`Node`]
//! tree, YAML input gets the YAML 1.1 scalar rules serde_yaml (YAML 1.2) lacks, and the tree is
//! decoded with encoding/json's rules: keys match case-insensitively, `null` leaves a field
//! alone, unknown keys are skipped, and the first type error wins. Error texts are upstream's,
//! with the file name and, where it can be found for sure, the line.

use std::path::Path;

mod decode;
mod directory;
mod file;
mod go_format;
mod locate;
mod model;
mod node;
mod plain_yaml;
mod tree;
mod validate;

use self::file::{read_bounded, unreadable};
pub use self::{
    decode::CidrList,
    directory::FILE_PREFIX,
    file::{cidr_line, parse},
    go_format::{format_go_duration, parse_go_bool, parse_go_duration},
    model::{Config, ConfigError, ConfigOptions, ConfigSource, Loaded, MAX_CONFIG_BYTES},
};

/// Reads and checks the config file. A file that does not exist means the defaults, as
/// upstream; any other read error (permissions, ...) is an error. A directory is read as
/// several files, merged: see [`directory`].
pub fn load(path: &Path, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    if path.is_dir() {
        return directory::load(path, opts);
    }
    let origin = path.display().to_string();
    match read_bounded(path) {
        Ok(text) => parse(&text, &origin, opts).map(|loaded| Loaded {
            files: vec![path.to_path_buf()],
            ..loaded
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Loaded {
            config: Config::defaults(opts),
            warnings: Vec::new(),
            source: ConfigSource::Missing,
            files: Vec::new(),
        }),
        Err(e) => Err(unreadable(&origin, e)),
    }
}

#[cfg(test)]
mod tests;
