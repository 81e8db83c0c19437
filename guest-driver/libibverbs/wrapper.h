/* What bindgen reads to produce src/abi.rs: the public libibverbs header,
 * and librdmacm's (the same shared object serves both, see src/rdmacm). */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
