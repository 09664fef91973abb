#!/bin/sh
# The image's entrypoint: points `iptables` and friends at the backend (nft or legacy) that the
# node already uses, then runs masq-agent with the container's arguments. This is upstream's
# iptables-wrapper approach. The two backends keep separate rule sets, so a chain written
# through the other one would sit beside kube-proxy's rules instead of among them, and the
# POSTROUTING order the agent relies on would not hold.
set -eu

# Where the chosen backend's commands are linked. /usr/local/sbin comes first on the image's
# PATH; the tests point this at a scratch directory.
link_dir=${IPTABLES_LINK_DIR:-/usr/local/sbin}

# Rule lines (`-A ...`) that a backend holds in every table of both families.
rules() {
    { "iptables-$1-save" || true; "ip6tables-$1-save" || true; } 2>/dev/null | grep -c '^-' || true
}

# Kubelet (1.24 and later) marks the backend it uses with this chain, which settles it.
has_kubelet_hint() {
    { "iptables-$1-save" -t mangle || true; "ip6tables-$1-save" -t mangle || true; } 2>/dev/null |
        grep -q '^:KUBE-IPTABLES-HINT '
}

if has_kubelet_hint nft; then
    backend=nft reason="kubelet's KUBE-IPTABLES-HINT chain is in nft"
elif has_kubelet_hint legacy; then
    backend=legacy reason="kubelet's KUBE-IPTABLES-HINT chain is in legacy"
else
    legacy=$(rules legacy)
    nft=$(rules nft)
    # A node with no rules at all (ties) gets nft, the default of current distributions.
    if [ "$legacy" -gt "$nft" ]; then backend=legacy; else backend=nft; fi
    reason="$legacy legacy and $nft nft rules on the node"
fi

mkdir -p "$link_dir"
for family in iptables ip6tables; do
    for suffix in "" -save -restore; do
        target=$(command -v "$family-$backend$suffix") || {
            echo "entrypoint: $family-$backend$suffix is not installed" >&2
            exit 1
        }
        ln -sf "$target" "$link_dir/$family$suffix"
    done
done
echo "entrypoint: iptables backend $backend ($reason)" >&2

exec masq-agent "$@"
