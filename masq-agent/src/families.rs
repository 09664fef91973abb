//! The address families: IPv4, and IPv6 where it is enabled. A leaf, which the config, the
//! policy and the data planes all take their families from.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum IpFamily {
    Ipv4,
    Ipv6,
}

impl IpFamily {
    pub const ALL: [IpFamily; 2] = [IpFamily::Ipv4, IpFamily::Ipv6];

    /// The family as `status`, its JSON and the metrics' `family` label spell it.
    pub fn label(self) -> &'static str {
        match self {
            IpFamily::Ipv4 => "ipv4",
            IpFamily::Ipv6 => "ipv6",
        }
    }
}

spelled_by_label!(IpFamily);

/// The address families the agent masquerades: IPv4 always, and IPv6 once enabled (by
/// `--enable-ipv6`, or by the file's `enableIPv6`, which wins).
/// IPv4 alone by default, as upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct IpFamilies {
    ipv6: bool,
}

impl IpFamilies {
    pub const IPV4: IpFamilies = IpFamilies { ipv6: false };
    pub const DUAL_STACK: IpFamilies = IpFamilies { ipv6: true };

    /// IPv4, and IPv6 if `ipv6`: what a flag or a file's `enableIPv6` says.
    pub fn with_ipv6(ipv6: bool) -> IpFamilies {
        IpFamilies { ipv6 }
    }

    /// These, unless a file's `enableIPv6` (`Config::enable_ipv6`) says otherwise: the file
    /// wins over the flag. The one place of that rule.
    pub fn as_the_file_says(self, enable_ipv6: Option<bool>) -> IpFamilies {
        enable_ipv6.map_or(self, IpFamilies::with_ipv6)
    }

    pub fn contains(self, family: IpFamily) -> bool {
        match family {
            IpFamily::Ipv4 => true,
            IpFamily::Ipv6 => self.ipv6,
        }
    }
}
