#!/usr/bin/env bash
# Prepares, and caches between runs, what vrdma's VM tests need (docs/vm.md):
# a Debian trixie root holding QEMU 11 from trixie-backports (the VMM runs
# in it through chroot), plus the guest's Debian kernel, its modules, a
# static busybox and Debian's RDMA userland (rdma-core's libibverbs with the
# rxe provider, ibverbs-utils, perftest, rdmacm-utils, iproute2's rdma,
# netcat-openbsd) with every shared library they need, unpacked under
# <root>/guest.
#
# Usage: tests/vm/prepare.sh        (as root; prints the prepared root's path)
# Environment:
#   VRDMA_VM_CACHE   cache directory (default /var/cache/vrdma-vm)
#   VRDMA_VM_MIRROR  Debian mirror (default http://deb.debian.org/debian)
#
# The root lives in <cache>/root-<key>, where <key> hashes the recipe below:
# changing the recipe builds a new root and removes the old ones. A build
# happens in a temporary directory renamed into place at the end, under an
# flock, so an interrupted or concurrent run never leaves a half root behind.
set -euo pipefail

# Bump when the steps below change in a way the package lists do not show.
readonly RECIPE_VERSION=2
readonly SUITE=trixie
# kmod: depmod for the unpacked guest modules (the initramfs builder reads
# modules.dep for load order).
readonly ROOT_PACKAGES=(qemu-system-x86 kmod)
# Unpacked, not installed: the guest's files, which the host never runs
# (installing linux-image would also build an initramfs nobody uses).
readonly GUEST_PACKAGES=(linux-image-amd64 busybox-static)
# The Soft-RoCE guest's userland (tests/src/vm/rxe.rs), unpacked the same
# way with its whole dependency closure (libc6, libnl-3, libnl-route-3, ...)
# as apt resolves it for an empty system: the initramfs builder picks the
# programs' shared libraries from there. netcat-openbsd: busybox's nc has
# no UDP. ucx-utils, openmpi-bin: UCX and Open MPI run on vrdma inside the
# guest (tests/tests/vm_contexts.rs).
readonly RDMA_GUEST_PACKAGES=(ibverbs-utils ibverbs-providers perftest rdmacm-utils iproute2 netcat-openbsd
    ucx-utils openmpi-bin)

cache=${VRDMA_VM_CACHE:-/var/cache/vrdma-vm}
mirror=${VRDMA_VM_MIRROR:-http://deb.debian.org/debian}

die() {
    echo "prepare.sh: $*" >&2
    exit 1
}
log() {
    echo "prepare.sh: $*" >&2
}

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap and chroot need it)"
for tool in debootstrap chroot flock sha256sum mount umount; do
    command -v "$tool" >/dev/null || die "$tool is missing (apt-get install debootstrap util-linux coreutils)"
done

key=$(printf '%s\n' "$RECIPE_VERSION" "$SUITE" "$mirror" "${ROOT_PACKAGES[*]}" "${GUEST_PACKAGES[*]}" \
    "${RDMA_GUEST_PACKAGES[*]}" |
    sha256sum | cut -c1-16)
root="$cache/root-$key"

mkdir -p "$cache" || die "cannot create the cache directory $cache"
exec 9>"$cache/.lock"
flock 9 || die "cannot lock $cache/.lock"

if [ -f "$root/.vrdma-ready" ]; then
    echo "$root"
    exit 0
fi

# Left-overs of interrupted runs and roots of older recipes. A build that
# was killed may still have /proc or /dev mounted inside: unmount first and
# never cross into another file system while deleting.
cleanup_dir() {
    local dir=$1 m
    for m in proc dev/pts dev; do
        if mountpoint -q "$dir/$m" 2>/dev/null; then
            umount "$dir/$m" || umount -l "$dir/$m" || die "cannot unmount $dir/$m"
        fi
    done
    rm -rf --one-file-system "$dir"
}
for old in "$cache"/root-* "$cache"/build.*; do
    [ -e "$old" ] || continue
    [ "$old" = "$root" ] && continue
    log "removing $old"
    cleanup_dir "$old"
done

build=$(mktemp -d "$cache/build.XXXXXX")
chmod 755 "$build"
trap 'cleanup_dir "$build"' EXIT
log "building $root (recipe $key) in $build"
start=$SECONDS

log "debootstrap --variant=minbase $SUITE"
if ! debootstrap --variant=minbase "$SUITE" "$build" "$mirror" >"$build.debootstrap.log" 2>&1; then
    tail -n 30 "$build.debootstrap.log" >&2
    rm -f "$build.debootstrap.log"
    die "debootstrap $SUITE from $mirror failed (log above)"
fi
rm -f "$build.debootstrap.log"

cat >"$build/etc/apt/sources.list" <<EOF
deb $mirror $SUITE main
deb $mirror $SUITE-backports main
EOF
cat >"$build/etc/apt/apt.conf.d/90vrdma" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
mount -t proc proc "$build/proc"
mount --bind /dev "$build/dev"

in_root() {
    chroot "$build" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"
}
run_logged() {
    local what=$1
    shift
    if ! in_root "$@" >"$cache/step.log" 2>&1; then
        tail -n 30 "$cache/step.log" >&2
        die "$what failed (log above)"
    fi
}

log "apt-get update"
run_logged "apt-get update in the $SUITE root" apt-get update
log "installing ${ROOT_PACKAGES[*]} from $SUITE-backports"
run_logged "installing ${ROOT_PACKAGES[*]}" \
    apt-get install -y -t "$SUITE-backports" "${ROOT_PACKAGES[@]}"

log "unpacking ${GUEST_PACKAGES[*]} into /guest"
# apt-get download takes exact names: resolve the metapackage to its kernel.
kernel_pkg=$(in_root apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$kernel_pkg" ] || die "cannot resolve linux-image-amd64 to a kernel package"
mkdir -p "$build/guest" "$build/var/tmp/guest-debs"
guest_debs=("$kernel_pkg" busybox-static)
run_logged "downloading ${guest_debs[*]}" \
    sh -c "cd /var/tmp/guest-debs && apt-get download ${guest_debs[*]}"
for deb in "$build"/var/tmp/guest-debs/*.deb; do
    dpkg-deb -x "$deb" "$build/guest" || die "cannot unpack $deb"
done
rm -rf "$build/var/tmp/guest-debs"

log "unpacking ${RDMA_GUEST_PACKAGES[*]} and their dependencies into /guest"
# apt resolves the closure against an empty package database, as for a
# system with nothing installed, and only downloads.
mkdir -p "$build/var/tmp/rdma-debs/partial" "$build/var/tmp/empty-dpkg"
: >"$build/var/tmp/empty-dpkg/status"
run_logged "downloading ${RDMA_GUEST_PACKAGES[*]} with their dependencies" \
    apt-get install -y --download-only \
    -o Dir::State::status=/var/tmp/empty-dpkg/status \
    -o Dir::Cache::archives=/var/tmp/rdma-debs \
    "${RDMA_GUEST_PACKAGES[@]}"
for deb in "$build"/var/tmp/rdma-debs/*.deb; do
    dpkg-deb -x "$deb" "$build/guest" || die "cannot unpack $deb"
done
rm -rf "$build/var/tmp/rdma-debs" "$build/var/tmp/empty-dpkg"

# Merged /usr like a trixie system, so tools looking in /lib/modules find
# them and the programs' loader (/lib64/ld-linux-x86-64.so.2) resolves.
for link in lib lib64 bin sbin; do
    [ -e "$build/guest/$link" ] && die "a guest package ships /$link outside /usr"
    ln -s "usr/$link" "$build/guest/$link"
done
kernel_version=$(basename "$(ls -d "$build"/guest/usr/lib/modules/*)")
run_logged "depmod for the guest kernel $kernel_version" depmod -b /guest "$kernel_version"
in_root apt-get clean

umount "$build/dev" "$build/proc"
# QEMU opens a tap netdev (-netdev tap,ifname=...) through /dev/net/tun,
# which the root's minimal /dev lacks.
mkdir -p "$build/dev/net"
mknod -m 600 "$build/dev/net/tun" c 10 200 || die "cannot create $build/dev/net/tun"

# Fail here, not in the first test, when the recipe no longer gives what
# the fixture expects.
in_root qemu-system-x86_64 --version >/dev/null || die "qemu-system-x86_64 does not run in the root"
in_root qemu-system-x86_64 -device help 2>/dev/null | grep -q vhost-user-test-device-pci ||
    die "this QEMU has no vhost-user-test-device-pci"
ls "$build"/guest/boot/vmlinuz-* >/dev/null 2>&1 || die "no guest kernel in $build/guest/boot"
[ -x "$build/guest/usr/bin/busybox" ] || die "no static busybox at $build/guest/usr/bin/busybox"
for file in usr/bin/ibv_rc_pingpong usr/bin/ibv_devinfo usr/bin/ib_write_bw usr/bin/rdma \
    usr/bin/nc.openbsd usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so \
    usr/bin/ucx_info usr/bin/ucx_perftest usr/bin/mpirun.openmpi \
    etc/libibverbs.d/rxe.driver usr/lib64/ld-linux-x86-64.so.2; do
    [ -e "$build/guest/$file" ] || die "no /$file in the guest tree"
done

printf '%s\n' "$key" >"$build/.vrdma-ready"
mv -T "$build" "$root"
trap - EXIT
rm -f "$cache/step.log"
log "ready in $((SECONDS - start)) s"
echo "$root"
