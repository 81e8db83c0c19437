/* What rdma-core's test suite found wrong in vrdma, each checked on its
 * own (tests/tests/rdma_core_suite.rs), on one device:
 * - the context's cmd_fd is an open descriptor of its own: dup() works (the
 *   suite dups it for ibv_import_device, which is refused with EOPNOTSUPP);
 * - a QP posts receives from INIT on and sends from RTS on: before that
 *   ibv_post_recv / ibv_post_send fail with EINVAL naming the first work
 *   request, and an ibv_wr_* batch fails at ibv_wr_complete (IBA
 *   C10-97.2.1, as Linux rxe).
 * Prints "suite findings OK" and exits 0 when all hold. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define CHECK(cond, ...)                                   \
	do {                                               \
		if (!(cond)) {                             \
			printf("FAILED: " __VA_ARGS__);    \
			printf(" (errno %d)\n", errno);    \
			return 1;                          \
		}                                          \
	} while (0)

static int to_state(struct ibv_qp *qp, enum ibv_qp_state state)
{
	struct ibv_qp_attr attr = { .qp_state = state, .pkey_index = 0, .port_num = 1 };
	int mask = IBV_QP_STATE;
	if (state == IBV_QPS_INIT)
		mask |= IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
	return ibv_modify_qp(qp, &attr, mask);
}

int main(void)
{
	int n = 0, ret;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1, "one device, got %d", n);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx, "ibv_open_device");

	CHECK(fcntl(ctx->cmd_fd, F_GETFD) >= 0, "cmd_fd %d is not open", ctx->cmd_fd);
	CHECK(ctx->cmd_fd != ctx->async_fd, "cmd_fd is async_fd");
	int dup_fd = dup(ctx->cmd_fd);
	CHECK(dup_fd >= 0, "dup(cmd_fd)");
	errno = 0;
	struct ibv_context *imported = ibv_import_device(dup_fd);
	CHECK(!imported && errno == EOPNOTSUPP, "ibv_import_device: %p", (void *)imported);
	close(dup_fd);

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK(pd && cq, "pd/cq");
	struct ibv_qp_init_attr_ex qattr = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = pd, .send_ops_flags = IBV_QP_EX_WITH_SEND,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &qattr);
	CHECK(qp, "ibv_create_qp_ex");
	struct ibv_qp_ex *qpx = ibv_qp_to_qp_ex(qp);
	CHECK(qpx, "ibv_qp_to_qp_ex");

	/* Work requests without SGEs: nothing to register. */
	struct ibv_recv_wr rwr = { .wr_id = 1 }, *bad_r = NULL;
	struct ibv_send_wr swr = { .wr_id = 2, .opcode = IBV_WR_SEND }, *bad_s = NULL;

	/* RESET: neither queue takes work. */
	ret = ibv_post_recv(qp, &rwr, &bad_r);
	CHECK(ret == EINVAL && bad_r == &rwr, "ibv_post_recv in RESET returned %d", ret);
	ret = ibv_post_send(qp, &swr, &bad_s);
	CHECK(ret == EINVAL && bad_s == &swr, "ibv_post_send in RESET returned %d", ret);
	ibv_wr_start(qpx);
	qpx->wr_id = 3;
	ibv_wr_send(qpx);
	ibv_wr_set_sge(qpx, 0, 0, 0);
	ret = ibv_wr_complete(qpx);
	CHECK(ret == EINVAL, "ibv_wr_complete in RESET returned %d", ret);

	/* INIT: receives yes, sends no. */
	CHECK(to_state(qp, IBV_QPS_INIT) == 0, "modify to INIT");
	bad_r = NULL;
	ret = ibv_post_recv(qp, &rwr, &bad_r);
	CHECK(ret == 0 && !bad_r, "ibv_post_recv in INIT returned %d", ret);
	bad_s = NULL;
	ret = ibv_post_send(qp, &swr, &bad_s);
	CHECK(ret == EINVAL && bad_s == &swr, "ibv_post_send in INIT returned %d", ret);

	/* Back to RESET: receives refused again. */
	CHECK(to_state(qp, IBV_QPS_RESET) == 0, "modify to RESET");
	bad_r = NULL;
	ret = ibv_post_recv(qp, &rwr, &bad_r);
	CHECK(ret == EINVAL && bad_r == &rwr, "ibv_post_recv after RESET returned %d", ret);

	CHECK(!ibv_destroy_qp(qp) && !ibv_destroy_cq(cq) && !ibv_dealloc_pd(pd), "destroy");
	CHECK(!ibv_close_device(ctx), "ibv_close_device");
	ibv_free_device_list(list);
	printf("suite findings OK\n");
	return 0;
}
