//! Checking the decoded values in upstream's order, with upstream's messages, and Go's way
//! of reading and writing CIDRs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net};

use super::{
    decode::{CidrItems, CidrList, FileFields, Problem, Setting},
    go_format::{format_go_duration, format_go_nanos, go_quote},
    model::{Config, ConfigOptions, MIN_RESYNC_INTERVAL, Standing},
};
use crate::families::IpFamily;

/// The config `fields` set, every other key at its default. `Standing::InDirectory`: the file is
/// one of several, whose lists are merged afterwards, so a list it leaves out is empty here
/// (the merge applies the default list when no file sets one).
pub(super) fn build_config<'a>(
    fields: &FileFields<'a>,
    opts: &ConfigOptions,
    standing: Standing,
    warnings: &mut Vec<String>,
) -> Result<Config, Problem<'a>> {
    let mut defaults = Config::defaults(opts);
    if standing == Standing::InDirectory {
        defaults.non_masquerade_cidrs.clear();
    }
    // The file's `enableIPv6` decides whether its IPv6 CIDRs are allowed.
    let opts = &ConfigOptions {
        families: opts.families.as_the_file_says(fields.enable_ipv6),
        ..*opts
    };
    let cidr_limit = fields
        .cidr_limit
        .as_ref()
        .map_or(defaults.cidr_limit, |s| s.value);
    check_cidr_count(fields, defaults.non_masquerade_cidrs.len(), cidr_limit)?;
    let non_masq = match &fields.cidrs {
        Some(list) => check_cidrs(&list.value, opts)?,
        None => defaults
            .non_masquerade_cidrs
            .iter()
            .map(|net| (*net, None))
            .collect(),
    };
    let set = |list: CidrList| match fields.list(list) {
        Some(list) => check_cidrs(&list.value, opts),
        None => Ok(Vec::new()),
    };
    let masq = set(CidrList::Masquerade)?;
    check_no_prefix_in_both(&non_masq, &masq, CidrList::NonMasquerade)?;
    let (non_masq_src, masq_src) = (
        set(CidrList::NonMasqueradeSrc)?,
        set(CidrList::MasqueradeSrc)?,
    );
    check_no_prefix_in_both(&non_masq_src, &masq_src, CidrList::NonMasqueradeSrc)?;
    let masquerade_address = match &fields.masq_address {
        Some(setting) => Some(check_address_v4(setting)?),
        None => None,
    };
    let masquerade_address_ipv6 = match &fields.masq_address_ipv6 {
        Some(setting) => Some(check_address_v6(setting, opts)?),
        None => None,
    };
    let nets = |list: Vec<(IpNet, _)>| list.into_iter().map(|(net, _)| net).collect();
    let (non_masquerade_cidrs, masquerade_cidrs) = (nets(non_masq), nets(masq));
    let (non_masquerade_src_cidrs, masquerade_src_cidrs) = (nets(non_masq_src), nets(masq_src));
    let resync_interval = match &fields.resync_interval {
        None => defaults.resync_interval,
        Some(setting) => match u64::try_from(setting.value) {
            Ok(nanos) if nanos > 0 => Duration::from_nanos(nanos),
            _ => {
                warnings.push(format!(
                    "resyncInterval {} is not positive; using {}",
                    format_go_nanos(setting.value),
                    format_go_duration(MIN_RESYNC_INTERVAL)
                ));
                MIN_RESYNC_INTERVAL
            }
        },
    };
    Ok(Config {
        non_masquerade_cidrs,
        masquerade_cidrs,
        non_masquerade_src_cidrs,
        masquerade_src_cidrs,
        masquerade_address,
        masquerade_address_ipv6,
        cidr_limit,
        masq_link_local: fields.masq_link_local.unwrap_or(defaults.masq_link_local),
        masq_link_local_ipv6: fields
            .masq_link_local_ipv6
            .unwrap_or(defaults.masq_link_local_ipv6),
        resync_interval,
        enable_ipv6: fields.enable_ipv6,
    })
}

/// Upstream checks the count before the CIDRs themselves, and also against the default list
/// when the file only lowers cidrLimit. The limit holds for every list together; the error is
/// on the key of the list that passes it.
pub(super) fn check_cidr_count<'a>(
    fields: &FileFields<'a>,
    default_count: usize,
    limit: i64,
) -> Result<(), Problem<'a>> {
    let within = |count: usize| i64::try_from(count).is_ok_and(|n| n <= limit);
    let mut count = 0;
    let mut anchor = None;
    for list in CidrList::ALL {
        let setting = fields.list(list);
        count += match (setting, list) {
            (Some(setting), _) => setting.value.len(),
            (None, CidrList::NonMasquerade) => default_count,
            (None, _) => 0,
        };
        if !within(count) && anchor.is_none() {
            anchor = setting.as_ref().map(|s| s.key);
        }
    }
    if within(count) {
        return Ok(());
    }
    let anchor = anchor.or_else(|| fields.cidr_limit.as_ref().map(|s| s.key));
    Err(Problem::new(
        format!(
            "the daemon can only accept up to {limit} CIDRs (excluding link-local), \
             but got {count} CIDRs (excluding link local)"
        ),
        anchor,
    ))
}

/// Each item of a list, checked, with the text it came from.
fn check_cidrs<'a>(
    list: &CidrItems<'a>,
    opts: &ConfigOptions,
) -> Result<Vec<(IpNet, Option<&'a String>)>, Problem<'a>> {
    list.iter()
        .map(|item| Ok((check_cidr(*item, opts)?, *item)))
        .collect()
}

/// A destination (or a source) is either masqueraded or not: a prefix in both lists of a pair
/// decides nothing. `non_masq_list` names the pair by its non-masquerade list.
fn check_no_prefix_in_both<'a>(
    non_masq: &[(IpNet, Option<&'a String>)],
    masq: &[(IpNet, Option<&'a String>)],
    non_masq_list: CidrList,
) -> Result<(), Problem<'a>> {
    let Some((_, item, other)) = first_in_both(non_masq, masq) else {
        return Ok(());
    };
    let text = go_quote(item.map_or("", String::as_str));
    let (keep, masquerade) = (non_masq_list.key(), non_masq_list.exceptions().key());
    let what = non_masq_list.holds();
    let mut problem = match other {
        Some(_) => Problem::new(
            format!(
                "CIDR {text} is in both {masquerade} and {keep}: \
                 a {what} is either masqueraded or not"
            ),
            *item,
        ),
        None => Problem::new(
            format!(
                "CIDR {text} is in {masquerade} and in the default {keep}: \
                 a {what} is either masqueraded or not"
            ),
            *item,
        ),
    };
    problem.also = other.map(|other| (keep, other));
    Err(problem)
}

/// The first exception whose prefix the non-masquerade list holds too, with where each entry
/// came from. Prefixes are hashed: lists of 100 000 are compared in linear time, and without
/// exceptions not at all.
pub(super) fn first_in_both<'l, T>(
    non_masq: &'l [(IpNet, T)],
    masq: &'l [(IpNet, T)],
) -> Option<(&'l IpNet, &'l T, &'l T)> {
    if masq.is_empty() {
        return None;
    }
    let non_masq: std::collections::HashMap<&IpNet, &T> =
        non_masq.iter().map(|(net, from)| (net, from)).collect();
    masq.iter()
        .find_map(|(net, from)| Some((net, from, *non_masq.get(net)?)))
}

pub(super) fn check_cidr<'a>(
    item: Option<&'a String>,
    opts: &ConfigOptions,
) -> Result<IpNet, Problem<'a>> {
    let text = item.map_or("", String::as_str);
    let problem = |message: String| Problem::new(message, item);
    let net = parse_go_cidr(text).ok_or_else(|| {
        problem(format!(
            "CIDR {} could not be parsed, invalid CIDR address: {text}",
            go_quote(text)
        ))
    })?;
    let network = net.network();
    if net.addr() != network {
        return Err(problem(format!(
            "CIDR {} is not aligned to a CIDR block, ip: {} network: {}",
            go_quote(text),
            go_quote(&go_ip_string(net.addr())),
            go_quote(&go_net_string(network, net.prefix_len()))
        )));
    }
    let as_go_sees_it = ipv4_mapped_as_ipv4(net);
    if as_go_sees_it.addr().is_ipv6() && !opts.families.contains(IpFamily::Ipv6) {
        return Err(problem(format!(
            "ipv6 is not enabled, but ipv6 cidr {text} provided. \
             Enable ipv6 using --enable-ipv6 agent flag"
        )));
    }
    Ok(as_go_sees_it)
}

/// `masqueradeAddress`: one IPv4 address a host can hold (not unspecified, loopback, multicast
/// nor the limited broadcast); an IPv4-mapped IPv6 address is its IPv4 one, as Go reads it.
fn check_address_v4<'a>(setting: &Setting<'a, &'a String>) -> Result<Ipv4Addr, Problem<'a>> {
    let text = setting.value.as_str();
    let problem = |why: &str| {
        Problem::new(
            format!("masqueradeAddress {} {why}", go_quote(text)),
            Some(setting.key),
        )
    };
    let addr = match text.parse::<IpAddr>() {
        Ok(IpAddr::V4(addr)) => addr,
        Ok(IpAddr::V6(v6)) => v6
            .to_ipv4_mapped()
            .ok_or_else(|| problem("is not an IPv4 address: use masqueradeAddressIPv6"))?,
        Err(_) => return Err(problem("could not be parsed as an IP address")),
    };
    if addr.is_unspecified() || addr.is_loopback() || addr.is_multicast() || addr.is_broadcast() {
        return Err(problem("is not an address a node can masquerade to"));
    }
    Ok(addr)
}

/// `masqueradeAddressIPv6`: one IPv6 address a host can hold, with IPv6 on.
fn check_address_v6<'a>(
    setting: &Setting<'a, &'a String>,
    opts: &ConfigOptions,
) -> Result<Ipv6Addr, Problem<'a>> {
    let text = setting.value.as_str();
    let problem = |why: String| Problem::new(why, Some(setting.key));
    let addr = match text.parse::<IpAddr>() {
        Ok(IpAddr::V6(addr)) if addr.to_ipv4_mapped().is_none() => addr,
        Ok(_) => {
            return Err(problem(format!(
                "masqueradeAddressIPv6 {} is not an IPv6 address: use masqueradeAddress",
                go_quote(text)
            )));
        }
        Err(_) => {
            return Err(problem(format!(
                "masqueradeAddressIPv6 {} could not be parsed as an IP address",
                go_quote(text)
            )));
        }
    };
    if !opts.families.contains(IpFamily::Ipv6) {
        return Err(problem(format!(
            "ipv6 is not enabled, but masqueradeAddressIPv6 {text} provided. \
             Enable ipv6 using --enable-ipv6 agent flag"
        )));
    }
    if addr.is_unspecified() || addr.is_loopback() || addr.is_multicast() {
        return Err(problem(format!(
            "masqueradeAddressIPv6 {} is not an address a node can masquerade to",
            go_quote(text)
        )));
    }
    Ok(addr)
}

/// Go's `net.ParseCIDR`: the `/len` is required, the length may have leading zeros, and the
/// address is strict (no zones, no leading zeros in IPv4 octets), as Rust's parser is too.
pub(super) fn parse_go_cidr(s: &str) -> Option<IpNet> {
    let (addr, len) = s.split_once('/')?;
    let ip: IpAddr = addr.parse().ok()?;
    if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = len.trim_start_matches('0');
    let prefix = if digits.is_empty() {
        0
    } else {
        digits.parse::<u8>().ok()?
    };
    IpNet::new(ip, prefix).ok()
}

/// Go treats an aligned IPv4-mapped CIDR such as `::ffff:10.0.0.0/104` as the IPv4 one it
/// covers (`10.0.0.0/8`), both when checking for IPv6 and when matching addresses.
pub(super) fn ipv4_mapped_as_ipv4(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net
        && let Some(v4) = v6.addr().to_ipv4_mapped()
        && let Some(prefix) = v6.prefix_len().checked_sub(96)
        && let Ok(v4net) = Ipv4Net::new(v4, prefix)
    {
        return IpNet::V4(v4net);
    }
    net
}

/// An address as Go prints it: IPv4-mapped IPv6 addresses in dotted form.
pub(super) fn go_ip_string(ip: IpAddr) -> String {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => v6.to_string(),
        },
        IpAddr::V4(v4) => v4.to_string(),
    }
}

/// A network as Go's `IPNet.String` prints it: an IPv4-mapped one as the IPv4 network.
pub(super) fn go_net_string(network: IpAddr, prefix: u8) -> String {
    if let IpAddr::V6(v6) = network
        && let Some(v4) = v6.to_ipv4_mapped()
        && let Some(v4_prefix) = prefix.checked_sub(96)
    {
        return format!("{v4}/{v4_prefix}");
    }
    format!("{network}/{prefix}")
}
