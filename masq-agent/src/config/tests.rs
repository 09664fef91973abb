//! The config file as upstream reads it: each case checked through `parse`, with upstream's
//! messages.

use std::time::Duration;

use ipnet::IpNet;

use super::{decode::suggest_key, go_format::go_quote, tree::MERGE_ERROR, *};
use crate::policy::{IpFamilies, IpFamily};

const V4_ONLY: ConfigOptions = ConfigOptions {
    nomasq_all_reserved_ranges: false,
    families: IpFamilies::IPV4,
};
const WITH_V6: ConfigOptions = ConfigOptions {
    nomasq_all_reserved_ranges: false,
    families: IpFamilies::DUAL_STACK,
};
const ORIGIN: &str = "/etc/config/ip-masq-agent";

fn net(s: &str) -> IpNet {
    s.parse().expect("test CIDR")
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn accept_with(text: &str, opts: &ConfigOptions) -> Loaded {
    match parse(text.as_bytes(), ORIGIN, opts) {
        Ok(loaded) => loaded,
        Err(e) => panic!("rejected {text:?}: {e}"),
    }
}

fn accept(text: &str) -> Loaded {
    accept_with(text, &V4_ONLY)
}

fn config(text: &str) -> Config {
    let loaded = accept(text);
    assert_eq!(loaded.source, ConfigSource::File);
    loaded.config
}

fn reject_with(text: &str, opts: &ConfigOptions) -> ConfigError {
    match parse(text.as_bytes(), ORIGIN, opts) {
        Ok(loaded) => panic!("accepted {text:?}: {loaded:?}"),
        Err(e) => {
            assert_eq!(e.origin, ORIGIN);
            e
        }
    }
}

fn reject(text: &str) -> ConfigError {
    reject_with(text, &V4_ONLY)
}

fn defaults() -> Config {
    Config::defaults(&V4_ONLY)
}

// --- upstream's YAML cases ---

#[test]
fn yaml_with_all_keys() {
    let expected = Config {
        non_masquerade_cidrs: nets(&["172.16.0.0/12", "10.0.0.0/8"]),
        masquerade_cidrs: vec![],
        non_masquerade_src_cidrs: vec![],
        masquerade_src_cidrs: vec![],
        masquerade_address: None,
        masquerade_address_ipv6: None,
        cidr_limit: 64,
        masq_link_local: true,
        masq_link_local_ipv6: false,
        resync_interval: Duration::from_secs(5),
        enable_ipv6: None,
    };
    let flow = "nonMasqueradeCIDRs: [172.16.0.0/12, 10.0.0.0/8]\n\
                cidrLimit: 64\nmasqLinkLocal: true\nresyncInterval: 5s\n";
    assert_eq!(config(flow), expected);
    let block = "nonMasqueradeCIDRs:\n  - 172.16.0.0/12\n  - 10.0.0.0/8\n\
                 cidrLimit: 64\nmasqLinkLocal: true\nresyncInterval: 5s\n";
    assert_eq!(config(block), expected);
}

#[test]
fn yaml_with_only_the_cidr_list() {
    let expected = Config {
        non_masquerade_cidrs: nets(&["192.168.0.0/16"]),
        ..defaults()
    };
    assert_eq!(config("nonMasqueradeCIDRs: [192.168.0.0/16]"), expected);
}

#[test]
fn yaml_with_only_masq_link_local() {
    let expected = Config {
        masq_link_local: true,
        ..defaults()
    };
    assert_eq!(config("masqLinkLocal: true"), expected);
}

#[test]
fn yaml_with_only_masq_link_local_ipv6() {
    let expected = Config {
        masq_link_local_ipv6: true,
        ..defaults()
    };
    assert_eq!(config("masqLinkLocalIPv6: true"), expected);
}

#[test]
fn yaml_with_only_resync_interval() {
    let expected = Config {
        resync_interval: Duration::from_secs(300),
        ..defaults()
    };
    assert_eq!(config("resyncInterval: 5m"), expected);
}

#[test]
fn invalid_yaml_is_rejected_with_its_line() {
    let e = reject("*");
    assert_eq!(e.line, Some(1));
    assert!(e.message.starts_with("invalid YAML: "), "{e}");
    assert!(e.message.contains("alias"), "{e}");
    assert!(!e.message.contains("at line"), "position given twice: {e}");

    let e = reject("cidrLimit: 3\nnonMasqueradeCIDRs: [10.0.0.0/8\nmasqLinkLocal: true\n");
    assert!(e.line.is_some_and(|line| line >= 2), "{e}");
    assert!(
        e.to_string().starts_with(&format!("{ORIGIN}: line ")),
        "{e}"
    );
}

// --- upstream's JSON cases ---

#[test]
fn json_with_all_keys() {
    let text = r#"{"nonMasqueradeCIDRs": ["172.16.0.0/12", "10.0.0.0/8"], "cidrLimit": 64,
                   "masqLinkLocal": true, "masqLinkLocalIPv6": true, "resyncInterval": "5s"}"#;
    let expected = Config {
        non_masquerade_cidrs: nets(&["172.16.0.0/12", "10.0.0.0/8"]),
        masquerade_cidrs: vec![],
        non_masquerade_src_cidrs: vec![],
        masquerade_src_cidrs: vec![],
        masquerade_address: None,
        masquerade_address_ipv6: None,
        cidr_limit: 64,
        masq_link_local: true,
        masq_link_local_ipv6: true,
        resync_interval: Duration::from_secs(5),
        enable_ipv6: None,
    };
    assert_eq!(config(text), expected);
}

#[test]
fn json_with_single_keys() {
    assert_eq!(
        config(r#"{"nonMasqueradeCIDRs": ["192.168.0.0/16"]}"#),
        Config {
            non_masquerade_cidrs: nets(&["192.168.0.0/16"]),
            ..defaults()
        }
    );
    assert_eq!(
        config(r#"{"masqLinkLocal": true}"#),
        Config {
            masq_link_local: true,
            ..defaults()
        }
    );
    assert_eq!(
        config(r#"{"resyncInterval": "5m"}"#),
        Config {
            resync_interval: Duration::from_secs(300),
            ..defaults()
        }
    );
    assert_eq!(config("  \n {}"), defaults());
}

#[test]
fn invalid_json_is_rejected_with_line_and_column() {
    let e = reject("{*");
    assert_eq!(e.line, Some(1));
    assert_eq!(e.message, "invalid JSON: key must be a string at column 2");
    assert_eq!(
        e.to_string(),
        format!("{ORIGIN}: line 1: invalid JSON: key must be a string at column 2")
    );

    let e = reject("{\n  \"cidrLimit\": 5,\n}\n");
    assert_eq!(e.line, Some(3));
    assert!(e.message.contains("trailing comma"), "{e}");
}

#[test]
fn json_unicode_escapes_are_decoded() {
    let c = config(r#"{"resyncInterval": "\u0035s"}"#);
    assert_eq!(c.resync_interval, Duration::from_secs(5));
    let c = config(r#"{"\u006dasqLinkLocal": true}"#);
    assert!(c.masq_link_local);
}

// --- missing and empty files ---

#[test]
fn missing_file_means_defaults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = ConfigOptions {
        nomasq_all_reserved_ranges: true,
        families: IpFamilies::IPV4,
    };
    let loaded = load(&dir.path().join("absent"), &opts).expect("defaults");
    assert_eq!(loaded.source, ConfigSource::Missing);
    assert_eq!(loaded.config, Config::defaults(&opts));
    assert!(loaded.warnings.is_empty());
}

#[test]
fn existing_file_is_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config");
    std::fs::write(&path, "cidrLimit: 3\nmasqLinkLocal: yes\n").expect("write");
    let loaded = load(&path, &V4_ONLY).expect("valid");
    assert_eq!(loaded.source, ConfigSource::File);
    assert_eq!(loaded.config.cidr_limit, 3);
    assert!(loaded.config.masq_link_local);
}

#[test]
fn errors_from_load_name_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config");
    std::fs::write(&path, "cidrLimit: [").expect("write");
    let e = load(&path, &V4_ONLY).expect_err("invalid");
    assert_eq!(e.origin, path.display().to_string());
    assert!(e.to_string().starts_with(&path.display().to_string()));
}

#[test]
fn a_directory_without_config_files_means_the_defaults() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("other.yaml"), "cidrLimit: 1\n").unwrap();
    let loaded = load(dir.path(), &V4_ONLY).expect("defaults");
    assert_eq!(loaded.source, ConfigSource::Missing);
    assert_eq!(loaded.config, defaults());
    assert!(loaded.files.is_empty());
    assert_eq!(
        loaded.warnings,
        [format!(
            "no file named ip-masq* in the directory {}: the defaults apply",
            dir.path().display()
        )]
    );
}

#[test]
fn empty_whitespace_and_comment_only_files_mean_defaults() {
    for text in [
        "",
        "   \n\t\n",
        "# nothing here\n  # still nothing\n",
        "---\n",
        "~\n",
    ] {
        let loaded = accept(text);
        assert_eq!(loaded.config, defaults(), "{text:?}");
        assert_eq!(loaded.source, ConfigSource::File);
        assert!(
            loaded.warnings.is_empty(),
            "{text:?}: {:?}",
            loaded.warnings
        );
    }
}

#[test]
fn a_top_level_value_that_is_not_a_mapping_is_rejected() {
    for (text, kind) in [
        ("- 10.0.0.0/8\n", "array"),
        ("hello", "string"),
        ("5", "number"),
    ] {
        let e = reject(text);
        assert!(
            e.message.starts_with(&format!(
                "json: cannot unmarshal {kind} into Go value of type MasqConfig"
            )),
            "{e}"
        );
    }
}

// --- CIDR rules ---

#[test]
fn ipv6_cidrs_need_enable_ipv6() {
    let text = "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]";
    let loaded = accept_with(text, &WITH_V6);
    assert_eq!(
        loaded.config.non_masquerade_cidrs,
        nets(&["10.0.0.0/8", "fc00::/7"])
    );

    let e = reject_with(text, &V4_ONLY);
    assert_eq!(
        e.message,
        "ipv6 is not enabled, but ipv6 cidr fc00::/7 provided. \
         Enable ipv6 using --enable-ipv6 agent flag"
    );
    assert_eq!(e.line, Some(1));
}

#[test]
fn the_ipv6_message_shows_the_cidr_as_written() {
    let e = reject(r#"{"nonMasqueradeCIDRs": ["FC00:0::/7"]}"#);
    assert!(e.message.contains("ipv6 cidr FC00:0::/7 provided"), "{e}");
}

#[test]
fn ipv4_mapped_cidrs_are_ipv4_as_in_go() {
    let c = config(r#"{"nonMasqueradeCIDRs": ["::ffff:10.0.0.0/104"]}"#);
    assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8"]));
    let e = reject(r#"{"nonMasqueradeCIDRs": ["::ffff:10.0.0.1/104"]}"#);
    assert_eq!(
        e.message,
        r#"CIDR "::ffff:10.0.0.1/104" is not aligned to a CIDR block, ip: "10.0.0.1" network: "10.0.0.0/8""#
    );
}

#[test]
fn unaligned_cidr_is_rejected() {
    let e = reject("nonMasqueradeCIDRs: [10.0.0.1/8]");
    assert_eq!(
        e.message,
        r#"CIDR "10.0.0.1/8" is not aligned to a CIDR block, ip: "10.0.0.1" network: "10.0.0.0/8""#
    );
    let e = reject_with("nonMasqueradeCIDRs: [\"fc00::1/7\"]", &WITH_V6);
    assert_eq!(
        e.message,
        r#"CIDR "fc00::1/7" is not aligned to a CIDR block, ip: "fc00::1" network: "fc00::/7""#
    );
}

#[test]
fn unparsable_cidrs_are_rejected() {
    let e = reject("nonMasqueradeCIDRs: [abcdefg]");
    assert_eq!(
        e.message,
        r#"CIDR "abcdefg" could not be parsed, invalid CIDR address: abcdefg"#
    );
    for bad in [
        "10.256.0.0/16",
        "10.0.0.0",
        "10.0.0.0/33",
        "010.0.0.0/8",
        "10.0.0.0/",
        "10.0.0.0/+8",
        "10.0.0.0/8/8",
        "10.0.0/8",
        " 10.0.0.0/8",
        "fe80::%eth0/64",
        "fc00::/129",
        "",
    ] {
        let text = format!(r#"{{"nonMasqueradeCIDRs": [{}]}}"#, serde_json::json!(bad));
        let e = reject_with(&text, &WITH_V6);
        assert_eq!(
            e.message,
            format!(
                "CIDR {} could not be parsed, invalid CIDR address: {bad}",
                go_quote(bad)
            )
        );
    }
}

#[test]
fn prefix_lengths_may_have_leading_zeros_as_in_go() {
    let c = config("nonMasqueradeCIDRs: [10.0.0.0/08, 0.0.0.0/0]");
    assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8", "0.0.0.0/0"]));
}

#[test]
fn a_null_list_item_is_an_empty_cidr() {
    let e = reject(r#"{"nonMasqueradeCIDRs": ["10.0.0.0/8", null]}"#);
    assert_eq!(
        e.message,
        r#"CIDR "" could not be parsed, invalid CIDR address: "#
    );
}

#[test]
fn cidr_limit_is_checked_before_the_cidrs() {
    let list = |n: usize| -> String {
        let items: Vec<String> = (0..n).map(|i| format!("\"10.{i}.0.0/16\"")).collect();
        items.join(", ")
    };
    let c = config(&format!("nonMasqueradeCIDRs: [{}]", list(64)));
    assert_eq!(c.non_masquerade_cidrs.len(), 64);

    let e = reject(&format!("nonMasqueradeCIDRs: [{}, bogus]", list(64)));
    assert_eq!(
        e.message,
        "the daemon can only accept up to 64 CIDRs (excluding link-local), \
         but got 65 CIDRs (excluding link local)"
    );
    assert_eq!(e.line, Some(1));
}

#[test]
fn an_error_line_is_found_through_quotes_escapes_and_comments() {
    // A `#` inside quotes, an escape the text does not show, and the value repeated in a
    // comment: the YAML parser's own positions still point at the one line.
    for (text, line) in [
        (
            "# not 10.0.0.0/33\nnote: \"a #hash\"\nnonMasqueradeCIDRs: [10.0.0.0/33]\n",
            3,
        ),
        (
            "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - \"10.0.0.0\\u002f33\"\n",
            3,
        ),
        // A block scalar is found where its text starts.
        (
            "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - >-\n    10.0.0.0/33\n",
            4,
        ),
    ] {
        let e = reject(text);
        assert!(e.message.contains("10.0.0.0/33"), "{e}");
        assert_eq!(e.line, Some(line), "{text:?}");
    }
}

#[test]
fn custom_cidr_limit() {
    let c = config("cidrLimit: 100\nnonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]");
    assert_eq!(c.cidr_limit, 100);

    let e = reject("cidrLimit: 1\nnonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]");
    assert_eq!(
        e.message,
        "the daemon can only accept up to 1 CIDRs (excluding link-local), \
         but got 2 CIDRs (excluding link local)"
    );
    assert_eq!(e.line, Some(2));

    // Upstream also holds the default list to a lowered limit.
    let e = reject("# the limit alone\ncidrLimit: 2\n");
    assert!(e.message.contains("up to 2 CIDRs") && e.message.contains("got 3"));
    assert_eq!(e.line, Some(2));

    // And a negative limit rejects even an empty list, like upstream.
    let e = reject("cidrLimit: -1\nnonMasqueradeCIDRs: []");
    assert!(e.message.contains("up to -1 CIDRs"), "{e}");
}

#[test]
fn empty_cidr_list_means_masquerade_everything() {
    for text in [
        "nonMasqueradeCIDRs:",
        "nonMasqueradeCIDRs:\n",
        "nonMasqueradeCIDRs: []",
        "nonMasqueradeCIDRs: ~",
        r#"{"nonMasqueradeCIDRs": null}"#,
        r#"{"nonMasqueradeCIDRs": []}"#,
    ] {
        let c = config(text);
        assert!(c.non_masquerade_cidrs.is_empty(), "{text:?}");
        assert!(!c.masq_link_local, "{text:?}");
    }
}

#[test]
fn all_reserved_ranges_default() {
    let opts = ConfigOptions {
        nomasq_all_reserved_ranges: true,
        families: IpFamilies::IPV4,
    };
    let expected = nets(&[
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "240.0.0.0/4",
    ]);
    assert_eq!(Config::defaults(&opts).non_masquerade_cidrs, expected);
    let loaded = accept_with("masqLinkLocal: true", &opts);
    assert_eq!(loaded.config.non_masquerade_cidrs, expected);
    assert_eq!(
        defaults().non_masquerade_cidrs,
        nets(&["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"])
    );
}

#[test]
fn duplicate_cidrs_are_kept() {
    let c = config("nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8, 192.168.0.0/16]");
    assert_eq!(
        c.non_masquerade_cidrs,
        nets(&["10.0.0.0/8", "10.0.0.0/8", "192.168.0.0/16"])
    );
}

// --- keys ---

#[test]
fn keys_match_case_insensitively() {
    let loaded = accept(
        "NONMASQUERADECIDRS: [10.0.0.0/8]\ncidrlimit: 5\n\
         MasqLinkLocal: true\nmasqlinklocalipv6: true\nRESYNCINTERVAL: 2s\n",
    );
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(
        loaded.config,
        Config {
            non_masquerade_cidrs: nets(&["10.0.0.0/8"]),
            masquerade_cidrs: vec![],
            non_masquerade_src_cidrs: vec![],
            masquerade_src_cidrs: vec![],
            masquerade_address: None,
            masquerade_address_ipv6: None,
            cidr_limit: 5,
            masq_link_local: true,
            masq_link_local_ipv6: true,
            resync_interval: Duration::from_secs(2),
            enable_ipv6: None,
        }
    );
    // Go folds Unicode too: the Kelvin sign is a K, the long s an S.
    assert!(config("masqLin\u{212a}Local: true").masq_link_local);
    assert_eq!(
        config("nonMasqueradeCIDR\u{17f}: []").non_masquerade_cidrs,
        vec![]
    );
}

#[test]
fn of_two_keys_for_one_field_the_last_wins() {
    let loaded = accept("nonMasqueradeCIDRs: [10.0.0.0/8]\nNONMASQUERADECIDRS: [192.168.0.0/16]");
    assert_eq!(
        loaded.config.non_masquerade_cidrs,
        nets(&["192.168.0.0/16"])
    );
    assert_eq!(
        loaded.warnings,
        vec![format!(
            "nonMasqueradeCIDRs is set 2 times in {ORIGIN}: the last one is used"
        )]
    );
    let c = config(r#"{"cidrLimit": 5, "cidrLimit": 7}"#);
    assert_eq!(c.cidr_limit, 7);
}

#[test]
fn a_yaml_key_written_twice_keeps_only_its_last_value() {
    // go-yaml builds a map first, so the first value is never decoded.
    let c = config("masqLinkLocal: 5\nmasqLinkLocal: true\n");
    assert!(c.masq_link_local);
    // Go's JSON decoder sees both, and the first one's type error counts.
    let e = reject(r#"{"masqLinkLocal": 5, "masqLinkLocal": true}"#);
    assert!(e.message.contains("of type bool"), "{e}");
}

#[test]
fn unknown_keys_are_ignored_with_a_warning() {
    let loaded = accept("nonMasqueradeCIDR: [1.2.3.0/24]\nfoo: 1\nresync-interval: 5s\n");
    assert_eq!(loaded.config, defaults());
    assert_eq!(
        loaded.warnings,
        vec![
            format!(
                "unknown key \"nonMasqueradeCIDR\" in {ORIGIN}: ignored; \
                 did you mean nonMasqueradeCIDRs?"
            ),
            format!("unknown key \"foo\" in {ORIGIN}: ignored"),
            format!(
                "unknown key \"resync-interval\" in {ORIGIN}: ignored; \
                 did you mean resyncInterval?"
            ),
        ]
    );
}

#[test]
fn suggestions_pick_the_closest_key() {
    assert_eq!(suggest_key("masqLinkLocalV6"), Some("masqLinkLocalIPv6"));
    assert_eq!(suggest_key("masq_link_local"), Some("masqLinkLocal"));
    assert_eq!(suggest_key("cidrlimt"), Some("cidrLimit"));
    assert_eq!(
        suggest_key("nonMasqueradeCIRDs"),
        Some("nonMasqueradeCIDRs")
    );
    assert_eq!(suggest_key("apiVersion"), None);
    assert_eq!(suggest_key("x"), None);
}

// --- values ---

#[test]
fn yaml_11_booleans_are_accepted_in_yaml() {
    for (word, value) in [
        ("y", true),
        ("Y", true),
        ("yes", true),
        ("Yes", true),
        ("YES", true),
        ("on", true),
        ("On", true),
        ("ON", true),
        ("true", true),
        ("True", true),
        ("TRUE", true),
        ("n", false),
        ("N", false),
        ("no", false),
        ("No", false),
        ("NO", false),
        ("off", false),
        ("Off", false),
        ("OFF", false),
        ("false", false),
        ("False", false),
        ("FALSE", false),
    ] {
        let c = config(&format!("masqLinkLocal: {word}\nmasqLinkLocalIPv6: {word}"));
        assert_eq!(c.masq_link_local, value, "{word}");
        assert_eq!(c.masq_link_local_ipv6, value, "{word}");
    }
}

#[test]
fn yaml_11_booleans_are_strings_in_json_and_in_quotes() {
    let e = reject(r#"{"masqLinkLocal": "yes"}"#);
    assert_eq!(
        e.message,
        "json: cannot unmarshal string into Go struct field MasqConfig.masqLinkLocal of type bool"
    );
    let e = reject("masqLinkLocal: \"true\"");
    assert!(e.message.contains("cannot unmarshal string"), "{e}");
    // A YAML 1.1 boolean where a string belongs is a type error, as upstream.
    let e = reject("nonMasqueradeCIDRs: [10.0.0.0/8, no]");
    assert_eq!(
        e.message,
        "json: cannot unmarshal bool into Go struct field MasqConfig.nonMasqueradeCIDRs of type string"
    );
}

#[test]
fn yaml_11_numbers() {
    assert_eq!(config("cidrLimit: 010").cidr_limit, 8);
    assert_eq!(config("cidrLimit: 1_000").cidr_limit, 1000);
    assert_eq!(config("cidrLimit: 0x40").cidr_limit, 64);
    assert_eq!(config("cidrLimit: 0b111").cidr_limit, 7);
    // A whole float becomes an int on upstream's way through JSON ...
    assert_eq!(config("cidrLimit: 64.0").cidr_limit, 64);
    assert_eq!(config("cidrLimit: 1e2").cidr_limit, 100);
    // ... but not in a JSON file.
    let e = reject(r#"{"cidrLimit": 64.0}"#);
    assert_eq!(
        e.message,
        "json: cannot unmarshal number 64.0 into Go struct field MasqConfig.cidrLimit of type int"
    );
}

#[test]
fn a_text_that_opens_no_quote_block_scalar_or_tag_holds_only_plain_scalars() {
    let text = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8 # pods\n  - &lab 192.168.0.0/16\n\
                masqLinkLocal: yes\nresyncInterval: 60s\nmasqueradeCIDRs: [*lab]\n";
    assert!(tree::only_plain_scalars(text.as_bytes()));
    let plain = tree::plain_scalars(text.as_bytes(), 100).unwrap();
    assert!(plain.len() >= 8 && plain.iter().all(|p| *p), "{plain:?}");
    for opener in ['\'', '"', '|', '>', '!'] {
        let with = format!("# {opener}\n{text}");
        assert!(!tree::only_plain_scalars(with.as_bytes()), "{opener}");
    }
}

#[test]
fn quoted_and_block_scalars_stay_strings_as_in_go_yaml_v2() {
    for text in [
        "masqLinkLocal: \"yes\"",
        "masqLinkLocal: 'on'",
        "masqLinkLocal: |\n  yes\n",
        "masqLinkLocal: >\n  no\n",
        "masqLinkLocal: !!str yes",
    ] {
        let e = reject(text);
        assert_eq!(
            e.message,
            "json: cannot unmarshal string into Go struct field MasqConfig.masqLinkLocal of type bool",
            "{text:?}"
        );
    }
    for text in [
        "cidrLimit: '010'",
        "cidrLimit: \"0x40\"",
        "cidrLimit: \"1_000\"",
    ] {
        let e = reject(text);
        assert_eq!(
            e.message,
            "json: cannot unmarshal string into Go struct field MasqConfig.cidrLimit of type int",
            "{text:?}"
        );
    }
    // The same scalar written plain is a YAML 1.1 value, however it is reached.
    let c = config("base: &plain yes\nmasqLinkLocal: *plain\ncidrLimit: 010\n");
    assert!(c.masq_link_local);
    assert_eq!(c.cidr_limit, 8);
    let e = reject("base: &quoted 'yes'\nmasqLinkLocal: *quoted\n");
    assert!(e.message.contains("cannot unmarshal string"), "{e}");
    // Keys before a value do not shift which scalar is read as quoted.
    let c = config("'nonMasqueradeCIDRs': ['10.0.0.0/8']\n\"masqLinkLocal\": on\n");
    assert!(c.masq_link_local);
    assert_eq!(c.non_masquerade_cidrs.len(), 1);
    // A merged mapping keeps its scalars' styles.
    let c = config("defaults: &d {masqLinkLocal: yes, cidrLimit: '64'}\n<<: *d\ncidrLimit: 7\n");
    assert!(c.masq_link_local);
    assert_eq!(c.cidr_limit, 7);
    let e = reject("defaults: &d {cidrLimit: '64'}\n<<: *d\n");
    assert!(e.message.contains("cannot unmarshal string"), "{e}");
}

#[test]
fn non_finite_yaml_floats_are_rejected_like_upstream() {
    let e = reject("somethingElse: .inf\n");
    assert_eq!(e.message, "json: unsupported value: +Inf");
    let e = reject("cidrLimit: .nan\n");
    assert_eq!(e.message, "json: unsupported value: NaN");
}

#[test]
fn non_positive_resync_interval_is_replaced_by_one_second() {
    for (text, shown) in [
        ("resyncInterval: -5s", "-5s"),
        ("resyncInterval: 0s", "0s"),
        ("resyncInterval: \"0\"", "0s"),
        (r#"{"resyncInterval": "-1m30s"}"#, "-1m30s"),
    ] {
        let loaded = accept(text);
        assert_eq!(
            loaded.config.resync_interval,
            Duration::from_secs(1),
            "{text}"
        );
        assert_eq!(
            loaded.warnings,
            vec![format!("resyncInterval {shown} is not positive; using 1s")]
        );
    }
}

#[test]
fn wrong_types_are_rejected_with_go_messages() {
    let field = |name: &str, what: &str, go_type: &str| {
        format!(
            "json: cannot unmarshal {what} into Go struct field MasqConfig.{name} of type {go_type}"
        )
    };
    let cases = [
        ("masqLinkLocal: 1", field("masqLinkLocal", "number", "bool")),
        (
            "masqLinkLocalIPv6: [true]",
            field("masqLinkLocalIPv6", "array", "bool"),
        ),
        (
            "nonMasqueradeCIDRs: 10.0.0.0/8",
            field("nonMasqueradeCIDRs", "string", "[]string"),
        ),
        (
            "nonMasqueradeCIDRs: {a: b}",
            field("nonMasqueradeCIDRs", "object", "[]string"),
        ),
        (
            "nonMasqueradeCIDRs: [10.0.0.0/8, 10]",
            field("nonMasqueradeCIDRs", "number", "string"),
        ),
        (
            "nonMasqueradeCIDRs: [[10.0.0.0/8]]",
            field("nonMasqueradeCIDRs", "array", "string"),
        ),
        ("cidrLimit: 64.5", field("cidrLimit", "number 64.5", "int")),
        (
            "cidrLimit: 99999999999999999999",
            field("cidrLimit", "number 99999999999999999999", "int"),
        ),
        ("cidrLimit: \"64\"", field("cidrLimit", "string", "int")),
        ("cidrLimit: true", field("cidrLimit", "bool", "int")),
        (
            r#"{"cidrLimit": 9223372036854775808}"#,
            field("cidrLimit", "number 9223372036854775808", "int"),
        ),
        (
            "resyncInterval: 60",
            r#"expected string value for unmarshal to field of type Duration, got "60""#.to_owned(),
        ),
        (
            "resyncInterval: [5s]",
            r#"expected string value for unmarshal to field of type Duration, got "[\"5s\"]""#
                .to_owned(),
        ),
        (
            "resyncInterval:",
            r#"expected string value for unmarshal to field of type Duration, got "null""#
                .to_owned(),
        ),
        (
            r#"{"resyncInterval": null}"#,
            r#"expected string value for unmarshal to field of type Duration, got "null""#
                .to_owned(),
        ),
        (
            "resyncInterval: abc",
            r#"time: invalid duration "abc""#.to_owned(),
        ),
        (
            "resyncInterval: \"5\"",
            r#"time: missing unit in duration "5""#.to_owned(),
        ),
        (
            "resyncInterval: 5d",
            r#"time: unknown unit "d" in duration "5d""#.to_owned(),
        ),
    ];
    for (text, message) in cases {
        let e = reject(text);
        assert_eq!(e.message, message, "{text}");
        assert_eq!(e.line, Some(1), "{text}");
    }
}

#[test]
fn null_leaves_bool_and_int_fields_alone() {
    let c = config("cidrLimit: null\nmasqLinkLocal:\nmasqLinkLocalIPv6: ~\n");
    assert_eq!(c, defaults());
    let c = config(r#"{"cidrLimit": null, "masqLinkLocal": null}"#);
    assert_eq!(c, defaults());
}

#[test]
fn a_duration_error_outranks_an_earlier_type_error() {
    // Go's decoder stops at a failing custom decoder but only notes type mismatches.
    let e = reject(r#"{"masqLinkLocal": 1, "resyncInterval": "abc"}"#);
    assert_eq!(e.message, r#"time: invalid duration "abc""#);
    let e = reject(r#"{"masqLinkLocal": 1, "cidrLimit": "x"}"#);
    assert!(e.message.contains("masqLinkLocal"), "{e}");
}

// --- lines in messages ---

#[test]
fn a_bad_cidr_is_reported_with_file_and_line() {
    let text = "nonMasqueradeCIDRs:\n  - 192.168.0.0/16\n  - 10.0.0.1/8\nmasqLinkLocal: true\n";
    let e = reject(text);
    assert_eq!(e.line, Some(3));
    assert_eq!(
        e.to_string(),
        format!(
            "{ORIGIN}: line 3: CIDR \"10.0.0.1/8\" is not aligned to a CIDR block, \
             ip: \"10.0.0.1\" network: \"10.0.0.0/8\""
        )
    );
}

#[test]
fn lines_are_found_past_comments_and_repeats() {
    // The same text in a comment and under an unknown key does not mislead.
    let text = "# 10.0.0.1/8 is wrong\nnotes: [10.0.0.1/8]\nnonMasqueradeCIDRs:\n\
                - 10.0.0.0/8\n- 10.0.0.1/8\n";
    assert_eq!(reject(text).line, Some(5));
    // JSON spread over lines: the key's line for a type error.
    let text = "{\n  \"cidrLimit\": 5,\n  \"masqLinkLocal\": \"no\"\n}";
    assert_eq!(reject(text).line, Some(3));
    // CRLF line ends.
    let text = "cidrLimit: 5\r\nnonMasqueradeCIDRs:\r\n- abc\r\n";
    assert_eq!(reject(text).line, Some(3));
}

#[test]
fn no_line_rather_than_a_wrong_one() {
    // The bad value also stands inside a longer string: the count disagrees.
    let text = "note: \"see 10.0.0.1/8\"\nnonMasqueradeCIDRs: [\"10.0.0.1/8\"]\n";
    let e = reject(text);
    assert!(e.message.contains("not aligned"), "{e}");
    // Written escaped in JSON, the key can't be found as text.
    let e = reject("{\n\"\\u006dasqLinkLocal\": 3}");
    assert!(e.message.contains("masqLinkLocal"), "{e}");
    assert_eq!(e.line, None);
    // An empty CIDR (from null) has no text to find.
    let e = reject("nonMasqueradeCIDRs:\n- 10.0.0.0/8\n- null\n");
    assert_eq!(e.line, None);
    assert_eq!(e.to_string(), format!("{ORIGIN}: {}", e.message));
}

// --- other YAML features ---

#[test]
fn only_the_first_yaml_document_counts() {
    let loaded = accept("cidrLimit: 5\n---\ncidrLimit: [\n");
    assert_eq!(loaded.config.cidr_limit, 5);
    assert_eq!(
        loaded.warnings,
        vec![format!(
            "{ORIGIN} holds more than one YAML document: only the first is used"
        )]
    );
    assert!(accept("cidrLimit: 5\n---\n").warnings.is_empty());
}

#[test]
fn yaml_anchors_tags_and_merge_keys() {
    let c = config(
        "base: &base\n  masqLinkLocal: true\n  cidrLimit: 5\n\
         <<: *base\ncidrLimit: 7\nnonMasqueradeCIDRs: &l [10.0.0.0/8]\n",
    );
    assert!(c.masq_link_local);
    assert_eq!(c.cidr_limit, 7);
    assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8"]));
    assert_eq!(config("cidrLimit: !!int \"9\"").cidr_limit, 9);
    assert!(config("masqLinkLocal: !custom true").masq_link_local);
    let e = reject("<<: 5\n");
    assert_eq!(e.message, MERGE_ERROR);
}

#[test]
fn hostile_input_is_rejected_without_panicking() {
    let deep = format!("a: {}", "[".repeat(100_000));
    assert_eq!(
        reject(&deep).message,
        "invalid YAML: nested more than 1000 levels deep"
    );
    let deep = format!("a: {}", "[".repeat(500));
    assert!(reject(&deep).message.contains("recursion limit"));
    let deep = format!("{{\"a\": {}", "[".repeat(100_000));
    assert!(reject(&deep).message.contains("recursion limit"));
    let mut laughs = String::from("a: &a [x, x, x, x, x, x, x, x, x]\n");
    for (name, prev) in ["b", "c", "d", "e", "f", "g", "h", "i"]
        .iter()
        .zip("abcdefgh".chars())
    {
        let refs = vec![format!("*{prev}"); 9].join(", ");
        laughs.push_str(&format!("{name}: &{name} [{refs}]\n"));
    }
    assert!(parse(laughs.as_bytes(), ORIGIN, &V4_ONLY).is_err());
    assert!(parse(b"\xff\xfe\x00{", ORIGIN, &V4_ONLY).is_err());
    assert!(parse(b"{\"a\": \"\xff\"}", ORIGIN, &V4_ONLY).is_err());
    let e = reject(&format!("resyncInterval: {}h", "9".repeat(5000)));
    assert!(e.message.starts_with("time: invalid duration"), "{e}");
    let many = format!(
        "nonMasqueradeCIDRs: [{}]",
        vec!["10.0.0.0/8"; 100_000].join(",")
    );
    assert!(reject(&many).message.contains("got 100000 CIDRs"));
    let e = reject("? [a, b]\n: c\n");
    assert!(e.message.contains("unsupported map key"), "{e}");
}

// --- output ---

#[test]
fn upstream_json_uses_upstream_keys() {
    let c = Config {
        non_masquerade_cidrs: nets(&["10.0.0.0/8", "fc00::/7"]),
        masquerade_cidrs: vec![],
        non_masquerade_src_cidrs: vec![],
        masquerade_src_cidrs: vec![],
        masquerade_address: None,
        masquerade_address_ipv6: None,
        cidr_limit: 10,
        masq_link_local: true,
        masq_link_local_ipv6: false,
        resync_interval: Duration::from_secs(90),
        enable_ipv6: None,
    };
    assert_eq!(
        c.to_upstream_json(),
        serde_json::json!({
            "nonMasqueradeCIDRs": ["10.0.0.0/8", "fc00::/7"],
            "cidrLimit": 10,
            "masqLinkLocal": true,
            "masqLinkLocalIPv6": false,
            "resyncInterval": "1m30s",
        })
    );
    assert_eq!(defaults().to_upstream_json()["resyncInterval"], "1m0s");
}

// --- masqueradeCIDRs: exceptions decided by the longest prefix ---

#[test]
fn masquerade_cidrs_are_read_beside_the_non_masquerade_ones() {
    let c = config(
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqueradeCIDRs:\n  - 10.100.10.0/24\n  - 10.200.0.0/16\n",
    );
    assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8"]));
    assert_eq!(
        c.masquerade_cidrs,
        nets(&["10.100.10.0/24", "10.200.0.0/16"])
    );
    // Without the list of non-masquerade CIDRs, the exceptions sit inside the defaults.
    let c = config("masqueradeCIDRs: [192.168.5.0/24]");
    assert_eq!(c.non_masquerade_cidrs, defaults().non_masquerade_cidrs);
    assert_eq!(c.masquerade_cidrs, nets(&["192.168.5.0/24"]));
    // `null` and `[]` mean none; the key matches as encoding/json matches keys.
    assert!(config("masqueradeCIDRs: null").masquerade_cidrs.is_empty());
    assert!(
        config(r#"{"MASQUERADECIDRS": []}"#)
            .masquerade_cidrs
            .is_empty()
    );
    assert_eq!(
        config(r#"{"masqueradecidrs": ["169.254.169.254/32"]}"#).masquerade_cidrs,
        nets(&["169.254.169.254/32"])
    );
}

#[test]
fn masquerade_cidrs_follow_the_rules_of_the_other_list() {
    let e = reject("masqueradeCIDRs:\n  - 10.100.10.1/24\n");
    assert_eq!(e.line, Some(2));
    assert!(e.message.contains("is not aligned to a CIDR block"), "{e}");
    let e = reject("masqueradeCIDRs: [nonsense]");
    assert!(e.message.contains("could not be parsed"), "{e}");
    let e = reject("masqueradeCIDRs: [fd00:1::/64]");
    assert!(e.message.contains("Enable ipv6 using --enable-ipv6"), "{e}");
    let c = accept_with("masqueradeCIDRs: [fd00:1::/64]", &WITH_V6).config;
    assert_eq!(c.masquerade_cidrs, nets(&["fd00:1::/64"]));
    let e = reject("masqueradeCIDRs: 10.0.0.0/8");
    assert_eq!(
        e.message,
        "json: cannot unmarshal string into Go struct field MasqConfig.masqueradeCIDRs of type []string"
    );
}

#[test]
fn a_prefix_in_both_lists_is_an_error_naming_both_places() {
    let e = reject(
        "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.100.0.0/16\nmasqueradeCIDRs:\n  - 10.100.0.0/16\n",
    );
    assert_eq!(e.line, Some(5), "{e}");
    assert_eq!(
        e.message,
        "CIDR \"10.100.0.0/16\" is in both masqueradeCIDRs and nonMasqueradeCIDRs: \
         a destination is either masqueraded or not; nonMasqueradeCIDRs has it at line 3"
    );
    // The same prefix written another way is the same prefix.
    let e = reject(
        r#"{"nonMasqueradeCIDRs": ["10.0.0.0/8"], "masqueradeCIDRs": ["::ffff:10.0.0.0/104"]}"#,
    );
    assert!(e.message.contains("in both"), "{e}");
    // One of the defaults.
    let e = reject("masqueradeCIDRs: [172.16.0.0/12]");
    assert_eq!(
        e.message,
        "CIDR \"172.16.0.0/12\" is in masqueradeCIDRs and in the default nonMasqueradeCIDRs: \
         a destination is either masqueraded or not"
    );
    // A longer prefix inside is what the key is for.
    config("masqueradeCIDRs: [172.16.0.0/13]");
}

#[test]
fn cidr_limit_counts_both_lists() {
    let list = |n: u8| {
        (0..n)
            .map(|i| format!("  - 10.{i}.0.0/16\n"))
            .collect::<String>()
    };
    let text = format!(
        "cidrLimit: 4\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqueradeCIDRs:\n{}",
        list(3)
    );
    config(&text);
    let text = format!(
        "cidrLimit: 4\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqueradeCIDRs:\n{}",
        list(4)
    );
    let e = reject(&text);
    assert_eq!(
        e.message,
        "the daemon can only accept up to 4 CIDRs (excluding link-local), \
         but got 5 CIDRs (excluding link local)"
    );
    assert_eq!(e.line, Some(4), "the key of the list that went over");
    // The defaults count too.
    let e = reject("cidrLimit: 3\nmasqueradeCIDRs: [10.1.0.0/16]\n");
    assert!(e.message.contains("but got 4 CIDRs"), "{e}");
}

#[test]
fn masquerade_cidrs_appear_in_the_printed_config_only_when_set() {
    let json = defaults().to_upstream_json();
    assert!(json.get("masqueradeCIDRs").is_none(), "{json}");
    let json = config("masqueradeCIDRs: [10.100.10.0/24]").to_upstream_json();
    assert_eq!(
        json["masqueradeCIDRs"],
        serde_json::json!(["10.100.10.0/24"])
    );
}

// --- a directory of config files, merged ---

/// A directory laid out as kubelet projects ConfigMaps: each key a symlink into `..data`, itself
/// a symlink to a timestamped directory.
fn projected(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("..2026_11_30_00_00_00.1");
    std::fs::create_dir(&data).unwrap();
    for (name, text) in files {
        std::fs::write(data.join(name), text).unwrap();
        std::os::unix::fs::symlink(format!("..data/{name}"), dir.path().join(name)).unwrap();
    }
    std::os::unix::fs::symlink(data.file_name().unwrap(), dir.path().join("..data")).unwrap();
    dir
}

#[test]
fn a_directory_of_files_is_merged() {
    let dir = projected(&[
        (
            "ip-masq-agent",
            "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\nresyncInterval: 30s\n",
        ),
        (
            "ip-masq-cloud",
            "nonMasqueradeCIDRs: [100.64.0.0/10, 10.0.0.0/8]\nmasqueradeCIDRs: [10.9.0.0/16]\nmasqLinkLocal: true\nresyncInterval: 10s\ncidrLimit: 3\n",
        ),
        ("other-settings", "cidrLimit: abc\n"),
        ("ip-masq-agent.bak", "cidrLimit: abc\n"),
        ("ip-masq-cloud~", "cidrLimit: abc\n"),
    ]);
    let loaded = load(dir.path(), &V4_ONLY).expect("merged");
    assert_eq!(loaded.source, ConfigSource::Directory);
    let names: Vec<_> = loaded
        .files
        .iter()
        .map(|f| f.file_name().unwrap())
        .collect();
    assert_eq!(names, ["ip-masq-agent", "ip-masq-cloud"]);
    let c = loaded.config;
    assert_eq!(
        c.non_masquerade_cidrs,
        nets(&["10.0.0.0/8", "192.168.0.0/16", "100.64.0.0/10"]),
        "joined, each once"
    );
    assert_eq!(c.masquerade_cidrs, nets(&["10.9.0.0/16"]));
    assert!(c.masq_link_local && !c.masq_link_local_ipv6, "ORed");
    assert_eq!(
        c.resync_interval,
        std::time::Duration::from_secs(10),
        "the smallest"
    );
    assert_eq!(c.cidr_limit, 64, "each file had its own");
}

#[test]
fn a_config_file_that_cannot_be_read_rejects_the_directory() {
    let dir = projected(&[("ip-masq-agent", "nonMasqueradeCIDRs: [10.0.0.0/8]\n")]);
    let broken = dir.path().join("ip-masq-broken");
    std::os::unix::fs::symlink(&broken, &broken).unwrap();
    std::fs::create_dir(dir.path().join("ip-masq-subdirectory")).unwrap();
    let e = load(dir.path(), &V4_ONLY).expect_err("a looping link");
    assert_eq!(e.origin, broken.display().to_string());
    assert!(
        e.message.starts_with("cannot read the config file: "),
        "{e}"
    );
}

#[test]
fn a_directory_of_one_file_reads_as_that_file() {
    for text in [
        "nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]\nresyncInterval: 5s\n",
        "masqLinkLocal: true\n",
        "",
    ] {
        let dir = projected(&[("ip-masq-agent", text)]);
        let alone = load(&dir.path().join("ip-masq-agent"), &V4_ONLY).unwrap();
        let merged = load(dir.path(), &V4_ONLY).unwrap();
        assert_eq!(merged.config, alone.config, "{text:?}");
    }
    // Defaults for the lists only when no file sets one: a file that sets another key only
    // adds no prefix.
    let dir = projected(&[
        ("ip-masq-a", "nonMasqueradeCIDRs: [10.0.0.0/8]\n"),
        ("ip-masq-b", "masqLinkLocal: true\n"),
    ]);
    assert_eq!(
        load(dir.path(), &V4_ONLY)
            .unwrap()
            .config
            .non_masquerade_cidrs,
        nets(&["10.0.0.0/8"])
    );
}

#[test]
fn an_invalid_file_rejects_the_directory_naming_the_file() {
    let dir = projected(&[
        ("ip-masq-agent", "nonMasqueradeCIDRs: [10.0.0.0/8]\n"),
        (
            "ip-masq-user",
            "resyncInterval: 1s\nnonMasqueradeCIDRs: [abcdefg]\n",
        ),
    ]);
    let e = load(dir.path(), &V4_ONLY).expect_err("invalid");
    assert_eq!(
        e.origin,
        dir.path().join("ip-masq-user").display().to_string()
    );
    assert_eq!(e.line, Some(2));
    assert!(e.message.contains("abcdefg"), "{e}");
    // Each file's own cidrLimit.
    let dir = projected(&[
        (
            "ip-masq-agent",
            "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n",
        ),
        (
            "ip-masq-user",
            "cidrLimit: 1\nnonMasqueradeCIDRs: [192.168.0.0/16]\n",
        ),
    ]);
    load(dir.path(), &V4_ONLY).expect("each file within its own limit");
}

#[test]
fn a_file_of_exceptions_is_checked_against_the_merged_lists_not_the_defaults() {
    let dir = projected(&[
        ("ip-masq-agent", "nonMasqueradeCIDRs: [172.16.0.0/12]\n"),
        (
            "ip-masq-user",
            "masqueradeCIDRs: [10.0.0.0/8]\ncidrLimit: 1\n",
        ),
    ]);
    let c = load(dir.path(), &V4_ONLY).expect("merged").config;
    assert_eq!(c.non_masquerade_cidrs, nets(&["172.16.0.0/12"]));
    assert_eq!(c.masquerade_cidrs, nets(&["10.0.0.0/8"]));
    // With no file setting the list, the defaults hold, and an exception equal to one of them
    // is the clash it is in a file alone.
    let dir = projected(&[("ip-masq-user", "masqueradeCIDRs: [10.0.0.0/8]\n")]);
    let e = load(dir.path(), &V4_ONLY).expect_err("clash with the defaults");
    assert!(
        e.message.contains("nonMasqueradeCIDRs in the defaults"),
        "{e}"
    );
}

#[test]
fn a_prefix_two_files_disagree_on_is_an_error_naming_both() {
    let dir = projected(&[
        (
            "ip-masq-agent",
            "resyncInterval: 1s\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.9.0.0/16\n",
        ),
        ("ip-masq-user", "masqueradeCIDRs:\n  - 10.9.0.0/16\n"),
    ]);
    let e = load(dir.path(), &V4_ONLY).expect_err("conflict");
    let path = |name: &str| dir.path().join(name).display().to_string();
    assert_eq!(e.origin, path("ip-masq-user"));
    assert_eq!(e.line, Some(2));
    assert_eq!(
        e.message,
        format!(
            "CIDR \"10.9.0.0/16\" is in masqueradeCIDRs here and in nonMasqueradeCIDRs in {} at line 4: \
             a destination is either masqueraded or not",
            path("ip-masq-agent")
        )
    );
}

#[test]
fn the_line_of_an_entry_is_found_in_any_form_go_reads() {
    let text = b"nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - ::ffff:172.16.0.0/108\nmasqueradeCIDRs: [10.9.0.0/16]\n";
    let line = |list, net: &str| cidr_line(text, &V4_ONLY, list, net.parse().unwrap());
    assert_eq!(line(CidrList::NonMasquerade, "10.0.0.0/8"), Some(2));
    assert_eq!(line(CidrList::NonMasquerade, "172.16.0.0/12"), Some(3));
    assert_eq!(line(CidrList::Masquerade, "10.9.0.0/16"), Some(4));
    assert_eq!(line(CidrList::Masquerade, "10.0.0.0/8"), None);
}

// --- enableIPv6 in the file ---

#[test]
fn enable_ipv6_in_the_file_overrides_the_flag() {
    // The file turns IPv6 on: its IPv6 CIDRs are allowed without the flag.
    let c = config("enableIPv6: true\nnonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n");
    assert_eq!(c.enable_ipv6, Some(true));
    assert!(
        IpFamilies::IPV4
            .as_the_file_says(c.enable_ipv6)
            .contains(IpFamily::Ipv6)
    );
    // And off, over the flag: then they are not.
    let e = reject_with(
        "nonMasqueradeCIDRs: [fd00::/8]\nenableIPv6: false\n",
        &WITH_V6,
    );
    assert!(e.message.contains("ipv6 is not enabled"), "{e}");
    let c = accept_with("enableIPv6: false\n", &WITH_V6).config;
    assert!(
        !IpFamilies::DUAL_STACK
            .as_the_file_says(c.enable_ipv6)
            .contains(IpFamily::Ipv6)
    );
    // Absent, the flag decides, and the printed config has no such key.
    assert_eq!(defaults().enable_ipv6, None);
    let ipv6 = |flag: IpFamilies| {
        flag.as_the_file_says(defaults().enable_ipv6)
            .contains(IpFamily::Ipv6)
    };
    assert!(ipv6(IpFamilies::DUAL_STACK) && !ipv6(IpFamilies::IPV4));
    assert!(defaults().to_upstream_json().get("enableIPv6").is_none());
    assert_eq!(c.to_upstream_json()["enableIPv6"], false);
    let e = reject("enableIPv6: 1");
    assert!(
        e.message.contains("MasqConfig.enableIPv6 of type bool"),
        "{e}"
    );
}

#[test]
fn enable_ipv6_is_ored_across_the_files_that_set_it() {
    let merged = |files: &[(&str, &str)]| load(projected(files).path(), &V4_ONLY).unwrap();
    let c = merged(&[
        ("ip-masq-a", "enableIPv6: false\n"),
        ("ip-masq-b", "enableIPv6: true\n"),
    ]);
    assert_eq!(c.config.enable_ipv6, Some(true));
    let c = merged(&[
        ("ip-masq-a", "enableIPv6: false\n"),
        ("ip-masq-b", "cidrLimit: 9\n"),
    ]);
    assert_eq!(c.config.enable_ipv6, Some(false));
    let c = merged(&[("ip-masq-a", "cidrLimit: 9\n")]);
    assert_eq!(c.config.enable_ipv6, None);
}

// --- nonMasqueradeSrcCIDRs and masqueradeSrcCIDRs: who is masqueraded ---

#[test]
fn source_lists_are_read_under_every_spelling_go_matches() {
    let c =
        config("nonMasqueradeSrcCIDRs:\n  - 0.0.0.0/0\nmasqueradeSrcCIDRs:\n  - 10.244.0.0/16\n");
    assert_eq!(c.non_masquerade_src_cidrs, nets(&["0.0.0.0/0"]));
    assert_eq!(c.masquerade_src_cidrs, nets(&["10.244.0.0/16"]));
    // Tencent TKE's and Azure's spellings, as encoding/json folds keys.
    for key in [
        "NonMasqueradeSrcCIDRs",
        "nonMasqueradeSRCCIDRs",
        "nonmasqueradesrccidrs",
    ] {
        let c = config(&format!("{key}: [10.244.5.0/24]"));
        assert_eq!(
            c.non_masquerade_src_cidrs,
            nets(&["10.244.5.0/24"]),
            "{key}"
        );
    }
    // Without them, no source is left alone, and the destination lists are as they were.
    let c = config("nonMasqueradeCIDRs: [10.0.0.0/8]");
    assert!(c.non_masquerade_src_cidrs.is_empty() && c.masquerade_src_cidrs.is_empty());
}

#[test]
fn source_lists_follow_the_rules_of_the_destination_lists() {
    let e = reject("nonMasqueradeSrcCIDRs: [10.244.5.1/24]");
    assert!(e.message.contains("is not aligned"), "{e}");
    let e = reject("masqueradeSrcCIDRs: [nonsense]");
    assert!(e.message.contains("could not be parsed"), "{e}");
    let e = reject("nonMasqueradeSrcCIDRs: [fd00:10:244::/48]");
    assert!(e.message.contains("ipv6 is not enabled"), "{e}");
    let c = accept_with("nonMasqueradeSrcCIDRs: [fd00:10:244::/48]", &WITH_V6).config;
    assert_eq!(c.non_masquerade_src_cidrs, nets(&["fd00:10:244::/48"]));
    let e = reject(
        "nonMasqueradeSrcCIDRs:\n  - 10.244.0.0/16\nmasqueradeSrcCIDRs:\n  - 10.244.0.0/16\n",
    );
    assert_eq!(e.line, Some(4), "{e}");
    assert_eq!(
        e.message,
        "CIDR \"10.244.0.0/16\" is in both masqueradeSrcCIDRs and nonMasqueradeSrcCIDRs: \
         a source is either masqueraded or not; nonMasqueradeSrcCIDRs has it at line 2"
    );
    // A prefix may be a destination left alone and a source left alone at once.
    config("nonMasqueradeCIDRs: [10.0.0.0/8]\nnonMasqueradeSrcCIDRs: [10.0.0.0/8]\n");
}

#[test]
fn cidr_limit_counts_the_source_lists_too() {
    let e = reject(
        "cidrLimit: 3\nnonMasqueradeCIDRs: [10.0.0.0/8]\nnonMasqueradeSrcCIDRs: [10.1.0.0/16]\n\
         masqueradeSrcCIDRs: [10.1.2.0/24, 10.1.3.0/24]\n",
    );
    assert_eq!(e.line, Some(4), "the list that passes the limit: {e}");
    assert!(e.message.contains("but got 4 CIDRs"), "{e}");
    config(
        "cidrLimit: 4\nnonMasqueradeCIDRs: [10.0.0.0/8]\nnonMasqueradeSrcCIDRs: [10.1.0.0/16]\n\
         masqueradeSrcCIDRs: [10.1.2.0/24, 10.1.3.0/24]\n",
    );
}

#[test]
fn source_lists_appear_in_the_printed_config_only_when_set() {
    let json = config("nonMasqueradeCIDRs: [10.0.0.0/8]").to_upstream_json();
    assert!(json.get("nonMasqueradeSrcCIDRs").is_none(), "{json}");
    assert!(json.get("masqueradeSrcCIDRs").is_none(), "{json}");
    let json = config("nonMasqueradeSrcCIDRs: [0.0.0.0/0]\nmasqueradeSrcCIDRs: [10.244.0.0/16]")
        .to_upstream_json();
    assert_eq!(
        json["nonMasqueradeSrcCIDRs"],
        serde_json::json!(["0.0.0.0/0"])
    );
    assert_eq!(
        json["masqueradeSrcCIDRs"],
        serde_json::json!(["10.244.0.0/16"])
    );
}

#[test]
fn source_lists_of_several_files_are_joined_and_a_clash_names_both_files() {
    let dir = projected(&[
        ("ip-masq-agent", "nonMasqueradeSrcCIDRs: [10.244.5.0/24]\n"),
        (
            "ip-masq-user",
            "nonMasqueradeSrcCIDRs: [10.244.6.0/24]\nmasqueradeSrcCIDRs: [10.244.5.128/25]\n",
        ),
    ]);
    let c = load(dir.path(), &V4_ONLY).expect("merged").config;
    assert_eq!(
        c.non_masquerade_src_cidrs,
        nets(&["10.244.5.0/24", "10.244.6.0/24"])
    );
    assert_eq!(c.masquerade_src_cidrs, nets(&["10.244.5.128/25"]));
    let dir = projected(&[
        (
            "ip-masq-agent",
            "resyncInterval: 1s\nnonMasqueradeSrcCIDRs: [10.244.5.0/24]\n",
        ),
        ("ip-masq-user", "masqueradeSrcCIDRs:\n  - 10.244.5.0/24\n"),
    ]);
    let e = load(dir.path(), &V4_ONLY).expect_err("a clash");
    assert!(e.origin.ends_with("ip-masq-user"), "{e}");
    assert_eq!(e.line, Some(2), "{e}");
    assert!(
        e.message
            .contains("is in masqueradeSrcCIDRs here and in nonMasqueradeSrcCIDRs in")
            && e.message.contains("ip-masq-agent at line 2")
            && e.message.ends_with("a source is either masqueraded or not"),
        "{e}"
    );
}

// --- masqueradeAddress and masqueradeAddressIPv6: the address masqueraded traffic takes ---

#[test]
fn a_masquerade_address_is_one_address_a_node_can_hold() {
    let c = config("masqueradeAddress: 198.51.100.7");
    assert_eq!(c.masquerade_address, Some("198.51.100.7".parse().unwrap()));
    assert_eq!(
        config("masqueradeAddress: ::ffff:198.51.100.7").masquerade_address,
        c.masquerade_address
    );
    assert_eq!(
        config("nonMasqueradeCIDRs: [10.0.0.0/8]").masquerade_address,
        None
    );
    for (text, why) in [
        ("masqueradeAddress: 198.51.100.0/24", "could not be parsed"),
        ("masqueradeAddress: nonsense", "could not be parsed"),
        (
            "masqueradeAddress: 0.0.0.0",
            "is not an address a node can masquerade to",
        ),
        (
            "masqueradeAddress: 224.0.0.1",
            "is not an address a node can masquerade to",
        ),
        (
            "masqueradeAddress: 2001:db8::7",
            "use masqueradeAddressIPv6",
        ),
        ("masqueradeAddress: [198.51.100.7]", "of type string"),
    ] {
        let e = reject(text);
        assert!(e.message.contains(why), "{text}: {e}");
        assert_eq!(e.line, Some(1), "{text}: {e}");
    }
    let e = reject("masqueradeAddressIPv6: 2001:db8::7");
    assert!(e.message.contains("ipv6 is not enabled"), "{e}");
    let c = accept_with("masqueradeAddressIPv6: 2001:db8::7", &WITH_V6).config;
    assert_eq!(
        c.masquerade_address_ipv6,
        Some("2001:db8::7".parse().unwrap())
    );
    let e = reject_with("masqueradeAddressIPv6: 198.51.100.7", &WITH_V6);
    assert!(e.message.contains("use masqueradeAddress"), "{e}");
}

#[test]
fn a_masquerade_address_appears_in_the_printed_config_only_when_set() {
    let json = config("nonMasqueradeCIDRs: [10.0.0.0/8]").to_upstream_json();
    assert!(json.get("masqueradeAddress").is_none(), "{json}");
    let json = config("masqueradeAddress: 198.51.100.7").to_upstream_json();
    assert_eq!(json["masqueradeAddress"], "198.51.100.7");
}

#[test]
fn files_that_name_two_masquerade_addresses_are_an_error_naming_both() {
    let dir = projected(&[
        ("ip-masq-agent", "masqueradeAddress: 198.51.100.7\n"),
        (
            "ip-masq-user",
            "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeAddress: 198.51.100.7\n",
        ),
    ]);
    let c = load(dir.path(), &V4_ONLY).expect("the same address twice");
    assert_eq!(
        c.config.masquerade_address,
        Some("198.51.100.7".parse().unwrap())
    );
    // The error is on the later file's line, and names the earlier file's.
    let clash = |agent: &str, user: &str, opts| {
        let dir = projected(&[("ip-masq-agent", agent), ("ip-masq-user", user)]);
        let e = load(dir.path(), opts).expect_err("two addresses");
        let agent = dir.path().join("ip-masq-agent").display().to_string();
        assert!(e.origin.ends_with("ip-masq-user"), "{e}");
        (e.line, e.message.replace(&agent, "AGENT"))
    };
    assert_eq!(
        clash(
            "resyncInterval: 1s\nmasqueradeAddress: 198.51.100.7\n",
            "nonMasqueradeCIDRs: [10.0.0.0/8]\n\nmasqueradeAddress: 198.51.100.8\n",
            &V4_ONLY
        ),
        (
            Some(3),
            "masqueradeAddress is 198.51.100.8 here and 198.51.100.7 in AGENT at line 2: \
             masqueraded traffic takes one address"
                .to_string()
        )
    );
    // JSON, and the IPv6 key as Go matches it.
    let (line, message) = clash(
        "{\"masqueradeAddressIPv6\": \"2001:db8::7\"}\n",
        "{\n  \"resyncInterval\": \"1s\",\n  \"MASQUERADEADDRESSIPV6\": \"2001:db8::8\"\n}\n",
        &WITH_V6,
    );
    assert_eq!(line, Some(3), "{message}");
    assert!(
        message.starts_with(
            "masqueradeAddressIPv6 is 2001:db8::8 here and 2001:db8::7 in AGENT at line 1:"
        ),
        "{message}"
    );
}
