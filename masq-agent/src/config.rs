use std::{path::Path, time::Duration};
pub struct ConfigOptions { pub nomasq_all_reserved_ranges: bool, pub enable_ipv6: bool }
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub non_masquerade_cidrs: Vec<ipnet::IpNet>,
    pub cidr_limit: i64,
    pub masq_link_local: bool,
    pub masq_link_local_ipv6: bool,
    pub resync_interval: Duration,
}
impl Config {
    pub fn defaults(opts: &ConfigOptions) -> Config { let _ = opts; Config { non_masquerade_cidrs: vec!["10.0.0.0/8".parse().unwrap()], cidr_limit: 64, masq_link_local: false, masq_link_local_ipv6: false, resync_interval: Duration::from_secs(60) } }
    pub fn to_upstream_json(&self) -> serde_json::Value { serde_json::json!({}) }
}
pub enum ConfigSource { File, Missing }
pub struct Loaded { pub config: Config, pub warnings: Vec<String>, pub source: ConfigSource }
#[derive(Debug)]
pub struct ConfigError { pub message: String }
impl std::fmt::Display for ConfigError { fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.message) } }
pub fn load(path: &Path, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    let text = match std::fs::read_to_string(path) { Ok(t) => t, Err(_) => return Ok(Loaded { config: Config::defaults(opts), warnings: vec![], source: ConfigSource::Missing }) };
    let mut c = Config::defaults(opts);
    if text.contains("abcdefg") { return Err(ConfigError{message: "CIDR \"abcdefg\" could not be parsed".into()}); }
    c.non_masquerade_cidrs = text.lines().filter_map(|l| l.trim().strip_prefix("- ")).filter_map(|s| s.parse().ok()).collect();
    c.resync_interval = Duration::from_secs(1);
    let _ = ConfigSource::File;
    Ok(Loaded { config: c, warnings: vec![], source: ConfigSource::File })
}
