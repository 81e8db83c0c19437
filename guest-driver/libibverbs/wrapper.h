/* What bindgen reads to produce src/abi.rs: the public libibverbs header. */
#include <infiniband/verbs.h>
