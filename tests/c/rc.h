/* What the C test programs share: CHECK, and bringing an RC QP to RTS
 * towards a peer QP on RoCE (GRH with the peer's GID, path MTU 1024). */
#ifndef VRDMA_TESTS_RC_H
#define VRDMA_TESTS_RC_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

/* Prints what failed (and errno), then exits 1. */
#define CHECK(cond, ...) do { if (!(cond)) { printf("FAILED: " __VA_ARGS__); printf(" (errno %d)\n", errno); fflush(stdout); exit(1); } } while (0)

/* RESET → INIT → RTR → RTS towards QP `dest` of the device with `gid`,
 * remote access `access`, `rd_atomic` READs/atomics in flight each way. */
static inline void rc_connect(struct ibv_qp *qp, uint32_t dest, union ibv_gid gid,
			      unsigned int access, uint8_t rd_atomic)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			    IBV_QP_ACCESS_FLAGS) == 0, "INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.max_dest_rd_atomic = rd_atomic;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
			    IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
			    IBV_QP_MIN_RNR_TIMER) == 0, "RTR");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = rd_atomic;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0, "RTS");
}

#endif
