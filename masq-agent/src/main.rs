fn main() {
    let obj = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/masq"));
    let mut ebpf = aya::Ebpf::load(obj).unwrap();
    for (n, _) in ebpf.maps() { println!("map {n}"); }
    let p: &mut aya::programs::SchedClassifier = ebpf.program_mut("masq_egress").unwrap().try_into().unwrap();
    p.load().unwrap();
    println!("loaded");
}
