/* Address vectors without a GRH (the peer named by LID alone, as programs
 * written for InfiniBand connect), on the first device. Built against
 * Debian's <infiniband/verbs.h> and libibverbs by tests/tests/qperf.rs and
 * run on the drop-in library.
 *
 *   lid_addressing DLID...   prints "port link_layer L lid N", then for
 *                            each DLID (hex or decimal) tries RTR of a
 *                            fresh RC QP and of a fresh UC QP and
 *                            ibv_create_ah, all with is_global 0 and that
 *                            dlid, and prints "dlid 0xD: rc E uc E ah E",
 *                            E the errno of each (0: it succeeded).
 *
 * Exits 0 when everything but those attempts succeeded; otherwise prints
 * what failed and exits 1. */
#include "rc.h"

/* RESET → INIT → RTR of a fresh QP of `type` towards LID `dlid`: the
 * errno of the RTR transition (0 if it succeeded). */
static int rtr_by_lid(struct ibv_pd *pd, struct ibv_cq *cq, enum ibv_qp_type type,
		      uint16_t dlid)
{
	struct ibv_qp_init_attr init = {
		.send_cq = cq,
		.recv_cq = cq,
		.qp_type = type,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4,
			 .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	int mask, ret;

	CHECK(qp, "ibv_create_qp");
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			    IBV_QP_ACCESS_FLAGS) == 0, "INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = 0x123;
	a.ah_attr.is_global = 0;
	a.ah_attr.dlid = dlid;
	a.ah_attr.port_num = 1;
	mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
	if (type == IBV_QPT_RC) {
		a.max_dest_rd_atomic = 1;
		a.min_rnr_timer = 12;
		mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
	}
	/* ibv_modify_qp returns the errno. */
	ret = ibv_modify_qp(qp, &a, mask);
	CHECK(ibv_destroy_qp(qp) == 0, "ibv_destroy_qp");
	return ret;
}

int main(int argc, char **argv)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	struct ibv_context *ctx;
	struct ibv_port_attr port;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	int i;

	setvbuf(stdout, NULL, _IOLBF, 0);
	CHECK(list && list[0], "ibv_get_device_list");
	ctx = ibv_open_device(list[0]);
	CHECK(ctx, "ibv_open_device");
	CHECK(ibv_query_port(ctx, 1, &port) == 0, "ibv_query_port");
	printf("port link_layer %d lid %d\n", port.link_layer, port.lid);
	pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd");
	cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	CHECK(cq, "ibv_create_cq");
	for (i = 1; i < argc; i++) {
		uint16_t dlid = (uint16_t)strtoul(argv[i], NULL, 0);
		struct ibv_ah_attr attr = { .dlid = dlid, .is_global = 0, .port_num = 1 };
		int rc = rtr_by_lid(pd, cq, IBV_QPT_RC, dlid);
		int uc = rtr_by_lid(pd, cq, IBV_QPT_UC, dlid);
		struct ibv_ah *ah;
		int ah_errno = 0;

		errno = 0;
		ah = ibv_create_ah(pd, &attr);
		if (ah)
			CHECK(ibv_destroy_ah(ah) == 0, "ibv_destroy_ah");
		else
			ah_errno = errno;
		printf("dlid 0x%x: rc %d uc %d ah %d\n", dlid, rc, uc, ah_errno);
	}
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	ibv_free_device_list(list);
	return 0;
}
