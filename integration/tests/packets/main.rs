//! Packet tests of the real object through BPF_PROG_TEST_RUN: crafted frames in, and every
//! output compared byte for byte with the frame the translation should produce, built from
//! scratch (checksums included) by the test bed's packet code, which shares nothing with the
//! programs' incremental checksum updates. Each test also lists the bytes a translation may
//! touch, and verifies from scratch every checksum it can.
//!
//! A case that exists in both families is written once over `family::HarnessFamily` and runs as
//! `<case>::ipv4` and `<case>::ipv6`, as the programs are written once over theirs; `ipv4` and
//! `ipv6` hold what one family alone has.

mod decisions;
mod devices;
mod family;
mod flow_state;
mod flows;
mod fragments;
mod icmp_errors;
mod ipv4;
mod ipv6;
mod policy_index;
mod strays;
