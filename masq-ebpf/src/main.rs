//! masq-agent's tc programs. Built for `bpfel-unknown-none` by masq-agent's build script.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

// First: its `step!` macro is used by the modules below.
#[cfg(target_arch = "bpf")]
#[macro_use]
mod verifier;
#[cfg(target_arch = "bpf")]
mod clock;
#[cfg(target_arch = "bpf")]
mod csum;
#[cfg(target_arch = "bpf")]
mod early_drop;
#[cfg(target_arch = "bpf")]
mod family;
#[cfg(target_arch = "bpf")]
mod flow_table;
#[cfg(target_arch = "bpf")]
mod frag;
#[cfg(target_arch = "bpf")]
mod hint;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod nat;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod policy;
#[cfg(target_arch = "bpf")]
mod ports;
#[cfg(target_arch = "bpf")]
mod programs;
#[cfg(target_arch = "bpf")]
mod sweep;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic, so this is never called.
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("masq-ebpf builds for bpfel-unknown-none; masq-agent's build script builds it");
    std::process::exit(1);
}
