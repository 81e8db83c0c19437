# Guest-side helpers for the VM tests, sourced by a test's script in the
# initramfs (busybox sh). They find the vrdma PCI function, take it from
# virtio-pci for uio_pci_generic, and read and write its virtio-pci
# registers through /dev/mem (busybox devmem), the way a user-space driver
# would through its BAR mapping.
#
# Needs: VRDMA_PCI_DEVICE (e.g. 0x1066 = 0x1040 + virtio id 38).

# Sets BDF to the vrdma function's address, or fails.
vrdma_find() {
    BDF=
    for d in /sys/bus/pci/devices/*; do
        if [ "$(cat "$d/vendor")" = 0x1af4 ] && [ "$(cat "$d/device")" = "$VRDMA_PCI_DEVICE" ]; then
            BDF=${d##*/}
        fi
    done
    [ -n "$BDF" ]
}

# Unbinds $BDF from its driver and binds it to uio_pci_generic.
vrdma_take() {
    dev=/sys/bus/pci/devices/$BDF
    if [ -e "$dev/driver" ]; then
        echo "$BDF" > "$dev/driver/unbind" || return 1
    fi
    echo "1af4 ${VRDMA_PCI_DEVICE#0x}" > /sys/bus/pci/drivers/uio_pci_generic/new_id || return 1
    [ "$(basename "$(readlink "$dev/driver")")" = uio_pci_generic ]
}

# Enables bus mastering (PCI COMMAND bit 2) on $BDF. A driver must: the
# device DMAs, and QEMU's virtio-pci clears DRIVER_OK (stopping the
# vhost-user backend) at any COMMAND write that leaves bus mastering off
# — uio_pci_generic's INTx masking writes COMMAND on every interrupt.
vrdma_bus_master() {
    lo=$(( $(cfg_u8 4) | 4 ))
    hi=$(cfg_u8 5)
    printf "\\$(printf %o "$lo")\\$(printf %o "$hi")" |
        dd of="/sys/bus/pci/devices/$BDF/config" bs=2 seek=2 count=1 conv=notrunc 2>/dev/null
    [ $(( $(cfg_u8 4) & 4 )) -ne 0 ]
}

# Config-space readers: byte and little-endian dword at offset $1.
cfg_u8() { hexdump -s "$1" -n 1 -e '1/1 "%u"' "/sys/bus/pci/devices/$BDF/config"; }
cfg_u32() { hexdump -s "$1" -n 4 -e '1/4 "%u"' "/sys/bus/pci/devices/$BDF/config"; }

# Prints the config space (hex bytes, 16 a line) between markers.
vrdma_dump_config() {
    echo "VRDMA-CONFIG-BEGIN"
    hexdump -v -e '16/1 "%02x " "\n"' "/sys/bus/pci/devices/$BDF/config"
    echo "VRDMA-CONFIG-END"
}

# Start address of BAR $1, from the sysfs resource table.
bar_start() {
    sed -n "$(($1 + 1))p" "/sys/bus/pci/devices/$BDF/resource" | cut -d' ' -f1
}

# Walks the capability list and sets COMMON and DEVICE to the physical
# addresses of the virtio common (cfg_type 1) and device-specific
# (cfg_type 4) configuration structures, printing every virtio capability.
vrdma_caps() {
    COMMON=
    DEVICE=
    off=$(cfg_u8 52)
    while [ "$off" -ne 0 ]; do
        id=$(cfg_u8 "$off")
        if [ "$id" -eq 9 ]; then
            type=$(cfg_u8 $((off + 3)))
            bar=$(cfg_u8 $((off + 4)))
            boff=$(cfg_u32 $((off + 8)))
            blen=$(cfg_u32 $((off + 12)))
            echo "VRDMA-CAP at=$off cfg_type=$type bar=$bar offset=$boff length=$blen"
            if [ "$type" -eq 1 ]; then
                COMMON=$(($(bar_start "$bar") + boff))
            elif [ "$type" -eq 4 ]; then
                DEVICE=$(($(bar_start "$bar") + boff))
            fi
        fi
        off=$(cfg_u8 $((off + 1)))
    done
    [ -n "$COMMON" ] && [ -n "$DEVICE" ]
}

# virtio common configuration registers (virtio 1.x, 4.1.4.3).
common_w() { devmem $((COMMON + $1)) "$2" "$3"; }
common_r() { devmem $((COMMON + $1)) "$2"; }
STATUS=20

# A driver's bring-up to DRIVER_OK: reset, ACKNOWLEDGE|DRIVER, VERSION_1,
# FEATURES_OK, the control queue (0) at guest-physical $1, DRIVER_OK.
vrdma_bring_up() {
    common_w $STATUS 8 0
    common_w $STATUS 8 3
    common_w 8 32 1
    common_w 12 32 1
    common_w 8 32 0
    common_w 12 32 0
    common_w $STATUS 8 11
    [ $(($(common_r $STATUS 8) & 8)) -ne 0 ] || return 1
    common_w 22 16 0
    # 64-bit registers as two 32-bit halves: the device's MMIO takes at
    # most 4 bytes an access. $1 is below 4 GiB.
    common_w 32 32 "$1"
    common_w 36 32 0
    common_w 40 32 $(($1 + 4096))
    common_w 44 32 0
    common_w 48 32 $(($1 + 8192))
    common_w 52 32 0
    common_w 28 16 1
    common_w $STATUS 8 15
    [ "$(($(common_r $STATUS 8)))" -eq 15 ]
}

# A driver's reset: status 0, and wait until the device reads back 0.
vrdma_reset() {
    common_w $STATUS 8 0
    [ "$(($(common_r $STATUS 8)))" -eq 0 ]
}
