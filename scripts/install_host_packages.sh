#!/usr/bin/env bash
# Host packages the local cluster's real nodes need (devcluster/realnode.py): containerd,
# runc, the CNI plugins, and gcc with a static libc for their locally built image; and the
# image builders (devcluster/buildah.py): buildah, mmdebstrap and podman. Run by
# `make binaries` (so by `make test` and CI). Where something is missing it installs the
# packages when it can (root with apt-get); elsewhere it says what to install and the
# real-node tests skip (or fail, with CI=true).
set -euo pipefail

# Keep in step with APT_PACKAGES in devcluster/realnode.py (a unit test compares them).
packages=(containerd runc containernetworking-plugins gcc libc6-dev iproute2 util-linux mount nftables)
# Keep in step with INSTALL in devcluster/buildah.py.
image_packages=(buildah mmdebstrap podman)

missing=()
for cmd in containerd containerd-shim-runc-v2 ctr runc gcc ip nsenter unshare mount umount nft; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [[ ! -x /usr/lib/cni/bridge && ! -x /opt/cni/bin/bridge ]]; then
    missing+=("CNI plugins")
fi
if command -v gcc >/dev/null 2>&1 \
        && ! echo 'int main(void) { return 0; }' | gcc -static -x c -o /dev/null - 2>/dev/null; then
    missing+=("a static libc")
fi
for cmd in buildah mmdebstrap podman; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing host packages for real nodes (missing: ${missing[*]})"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" "${image_packages[@]}"
else
    echo "note: real nodes and image builds need ${missing[*]}; install as root:" \
         "apt-get install -y ${packages[*]} ${image_packages[*]}" >&2
fi
