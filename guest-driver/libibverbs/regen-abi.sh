#!/usr/bin/env bash
# Regenerates src/abi.rs (the libibverbs type layouts) with bindgen from the
# installed <infiniband/verbs.h>. Needs Debian's libibverbs-dev, librdmacm-dev and
# libclang-dev. Run it after upgrading rdma-core's headers, then run
# `cargo test -p vrdma-libibverbs` (the layout tests) and review the diff.
set -euo pipefail
cd "$(dirname "$0")"
VRDMA_WRITE_ABI="$PWD/src/abi.rs" cargo build -p vrdma-libibverbs --features regenerate-abi
echo "wrote $PWD/src/abi.rs"
