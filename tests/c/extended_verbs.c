/* The extended verbs between two vrdma tenants in one process: device "a"
 * (tenant alpha) writes, reads and does atomics on device "b" (tenant
 * beta) through ibv_qp_ex (ibv_wr_*), both poll through ibv_cq_ex
 * (ibv_start_poll / ibv_next_poll / ibv_wc_read_*); and the queries and
 * refusals of the extended interface. Built against Debian's
 * <infiniband/verbs.h> and libibverbs by tests/tests/ibverbs_compat.rs and
 * run on the drop-in library. Prints "extended verbs OK" and exits 0 when
 * every check holds; otherwise names the first that failed. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>

#include "rc.h"


#define BUF 8192
#define IOVA 0x7e570000ULL /* device b's MR is registered at this iova */
#define WC_FLAGS (IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM | \
		  IBV_WC_EX_WITH_SRC_QP | IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL | \
		  IBV_WC_EX_WITH_DLID_PATH_BITS)
#define SEND_OPS (IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | \
		  IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ | \
		  IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq_ex *cq;
	struct ibv_qp *qp;
	struct ibv_qp_ex *qpx;
	struct ibv_mr *mr;
	unsigned char *buf;
	uint64_t base; /* the address RDMA to this side's MR uses */
	union ibv_gid gid;
};

struct got {
	uint64_t wr_id;
	int status, opcode;
	uint32_t byte_len, imm, qp_num, wc_flags;
};

static void read_one(struct ibv_cq_ex *cq, struct got *g)
{
	g->wr_id = cq->wr_id;
	g->status = cq->status;
	g->opcode = ibv_wc_read_opcode(cq);
	g->byte_len = ibv_wc_read_byte_len(cq);
	g->qp_num = ibv_wc_read_qp_num(cq);
	g->wc_flags = ibv_wc_read_wc_flags(cq);
	g->imm = (g->wc_flags & IBV_WC_WITH_IMM) ? ntohl(ibv_wc_read_imm_data(cq)) : 0;
}

/* Polls exactly n completions within 10 s. */
static void poll_n(struct ibv_cq_ex *cq, int n, struct got *out)
{
	struct ibv_poll_cq_attr attr = {};
	time_t deadline = time(NULL) + 10;
	int have = 0;
	while (have < n) {
		int ret = ibv_start_poll(cq, &attr);
		if (ret == ENOENT) {
			CHECK(time(NULL) < deadline, "%d of %d completions after 10 s", have, n);
			continue;
		}
		CHECK(ret == 0, "ibv_start_poll: %d", ret);
		read_one(cq, &out[have++]);
		while (have < n && (ret = ibv_next_poll(cq)) == 0)
			read_one(cq, &out[have++]);
		CHECK(ret == 0 || ret == ENOENT, "ibv_next_poll: %d", ret);
		ibv_end_poll(cq);
	}
}

static void expect(const struct got *g, uint64_t wr_id, int opcode, uint32_t len, const char *what)
{
	CHECK(g->wr_id == wr_id && g->status == IBV_WC_SUCCESS && g->opcode == opcode,
	      "%s: wr_id %llu status %d opcode %d", what, (unsigned long long)g->wr_id, g->status, g->opcode);
	CHECK(g->byte_len == len, "%s: byte_len %u, expected %u", what, g->byte_len, len);
}

static void open_side(struct ibv_device *dev, struct side *s, int iova)
{
	s->ctx = ibv_open_device(dev);
	CHECK(s->ctx, "ibv_open_device");
	s->pd = ibv_alloc_pd(s->ctx);
	CHECK(s->pd, "ibv_alloc_pd");
	struct ibv_cq_init_attr_ex cattr = { .cqe = 64, .wc_flags = WC_FLAGS };
	s->cq = ibv_create_cq_ex(s->ctx, &cattr);
	CHECK(s->cq, "ibv_create_cq_ex");
	struct ibv_qp_init_attr_ex qattr = {
		.send_cq = ibv_cq_ex_to_cq(s->cq), .recv_cq = ibv_cq_ex_to_cq(s->cq),
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 1,
			 .max_inline_data = 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = s->pd, .send_ops_flags = SEND_OPS,
	};
	s->qp = ibv_create_qp_ex(s->ctx, &qattr);
	CHECK(s->qp, "ibv_create_qp_ex");
	s->qpx = ibv_qp_to_qp_ex(s->qp);
	CHECK(s->qpx && &s->qpx->qp_base == s->qp, "ibv_qp_to_qp_ex");
	s->buf = aligned_alloc(4096, BUF);
	CHECK(s->buf, "aligned_alloc");
	memset(s->buf, 0, BUF);
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
		     IBV_ACCESS_REMOTE_ATOMIC;
	if (iova) {
		s->mr = ibv_reg_mr_iova2(s->pd, s->buf, BUF, IOVA, access);
		s->base = IOVA;
	} else {
		s->mr = ibv_reg_mr(s->pd, s->buf, BUF, access);
		s->base = (uintptr_t)s->buf;
	}
	CHECK(s->mr, "ibv_reg_mr%s", iova ? "_iova2" : "");
	struct ibv_gid_entry e;
	CHECK(ibv_query_gid_ex(s->ctx, 1, 0, &e, 0) == 0, "ibv_query_gid_ex");
	CHECK(e.gid_type == IBV_GID_TYPE_ROCE_V2 && e.port_num == 1 && e.gid_index == 0,
	      "ibv_query_gid_ex: type %u port %u index %u", e.gid_type, e.port_num, e.gid_index);
	CHECK(ibv_query_gid(s->ctx, 1, 0, &s->gid) == 0, "ibv_query_gid");
	CHECK(memcmp(&s->gid, &e.gid, sizeof(s->gid)) == 0, "ibv_query_gid_ex: another GID");
}

static void connect_to(struct side *s, const struct side *peer)
{
	rc_connect(s->qp, peer->qp->qp_num, peer->gid,
		   IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC, 4);
}

static void post_recv(struct side *s, uint64_t wr_id, size_t off, uint32_t len)
{
	/* In the MR's address space: its iova for b's. */
	struct ibv_sge sge = { .addr = s->base + off, .length = len, .lkey = s->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK(ibv_post_recv(s->qp, &wr, &bad) == 0, "ibv_post_recv");
}

static void queries(struct side *s)
{
	struct ibv_device_attr attr;
	struct ibv_device_attr_ex ex;
	CHECK(ibv_query_device(s->ctx, &attr) == 0, "ibv_query_device");
	memset(&ex, 0xa5, sizeof(ex));
	CHECK(ibv_query_device_ex(s->ctx, NULL, &ex) == 0, "ibv_query_device_ex");
	CHECK(memcmp(&ex.orig_attr, &attr, sizeof(attr)) == 0, "query_device_ex: orig_attr differs");
	CHECK(ex.phys_port_cnt_ex == 1 && ex.device_cap_flags_ex == attr.device_cap_flags,
	      "query_device_ex: ports %u caps %llx", ex.phys_port_cnt_ex,
	      (unsigned long long)ex.device_cap_flags_ex);
	CHECK(ex.odp_caps.general_caps == 0 && ex.tso_caps.max_tso == 0 && ex.max_dm_size == 0,
	      "query_device_ex: capabilities vrdma lacks are not zero");
	CHECK(attr.max_qp_rd_atom > 0 && attr.atomic_cap != IBV_ATOMIC_NONE, "RC device attributes");

	struct ibv_gid_entry table[8];
	ssize_t n = ibv_query_gid_table(s->ctx, table, 8, 0);
	CHECK(n == 1, "ibv_query_gid_table: %zd entries", n);
	CHECK(table[0].gid_type == IBV_GID_TYPE_ROCE_V2 && table[0].port_num == 1 &&
	      memcmp(&table[0].gid, &s->gid, sizeof(s->gid)) == 0, "ibv_query_gid_table: entry 0");
	CHECK(ibv_query_gid_table(s->ctx, table, 0, 0) == -EINVAL, "gid table: no room is EINVAL");
	CHECK(ibv_query_gid_table(s->ctx, table, 8, 1) == -EOPNOTSUPP, "gid table: flags are EOPNOTSUPP");
	struct ibv_gid_entry e;
	CHECK(ibv_query_gid_ex(s->ctx, 1, 0, &e, 1) == EOPNOTSUPP, "gid_ex: flags are EOPNOTSUPP");
	CHECK(ibv_query_gid_ex(s->ctx, 1, 5, &e, 0) != 0, "gid_ex: index beyond the table");

	CHECK(ibv_query_qp_data_in_order(s->qp, IBV_WR_RDMA_WRITE, 0) == 0, "data_in_order");
	CHECK(ibv_is_fork_initialized() == IBV_FORK_UNNEEDED, "ibv_is_fork_initialized");
}

static void refusals(struct side *s)
{
	errno = 0;
	CHECK(!ibv_import_device(-1) && errno == EOPNOTSUPP, "ibv_import_device");
	errno = 0;
	CHECK(!ibv_import_pd(s->ctx, 1) && errno == EOPNOTSUPP, "ibv_import_pd");
	errno = 0;
	CHECK(!ibv_import_mr(s->pd, 1) && errno == EOPNOTSUPP, "ibv_import_mr");
	errno = 0;
	CHECK(!ibv_import_dm(s->ctx, 1) && errno == EOPNOTSUPP, "ibv_import_dm");
	errno = 0;
	CHECK(!ibv_reg_dmabuf_mr(s->pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE) && errno == EOPNOTSUPP,
	      "ibv_reg_dmabuf_mr");

	struct ibv_cq_init_attr_ex cattr = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP };
	errno = 0;
	CHECK(!ibv_create_cq_ex(s->ctx, &cattr) && errno == EOPNOTSUPP, "cq_ex with timestamps");

	struct ibv_qp_init_attr_ex qattr = {
		.send_cq = ibv_cq_ex_to_cq(s->cq), .recv_cq = ibv_cq_ex_to_cq(s->cq), .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = s->pd, .send_ops_flags = IBV_QP_EX_WITH_BIND_MW,
	};
	errno = 0;
	CHECK(!ibv_create_qp_ex(s->ctx, &qattr) && errno == EOPNOTSUPP, "qp_ex with BIND_MW");
	/* A QP made without send_ops_flags has no ibv_qp_ex (as rdma-core). */
	qattr.comp_mask = IBV_QP_INIT_ATTR_PD;
	struct ibv_qp *plain = ibv_create_qp_ex(s->ctx, &qattr);
	CHECK(plain && !ibv_qp_to_qp_ex(plain), "a plain QP has no ibv_qp_ex");
	CHECK(ibv_destroy_qp(plain) == 0, "destroy the plain QP");
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 2, "two devices, got %d", n);
	struct side a, b;
	open_side(list[0], &a, 0);
	open_side(list[1], &b, 1);
	queries(&a);
	refusals(&a);
	connect_to(&a, &b);
	connect_to(&b, &a);

	/* Batch 1: WRITE (one SGE), WRITE_WITH_IMM (inline), SEND (two SGEs),
	 * SEND_WITH_IMM (inline list), rung once by ibv_wr_complete. */
	for (int i = 0; i < 256; i++)
		a.buf[i] = (unsigned char)(i * 7 + 1);
	post_recv(&b, 100, 4096, 256);
	post_recv(&b, 101, 4096 + 256, 256);
	post_recv(&b, 102, 4096 + 512, 256);
	ibv_wr_start(a.qpx);
	a.qpx->wr_id = 1;
	a.qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(a.qpx, b.mr->rkey, b.base + 0);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf, 64);
	a.qpx->wr_id = 2;
	ibv_wr_rdma_write_imm(a.qpx, b.mr->rkey, b.base + 64, htonl(0x12345678));
	ibv_wr_set_inline_data(a.qpx, a.buf + 64, 32);
	a.qpx->wr_id = 3;
	ibv_wr_send(a.qpx);
	struct ibv_sge two[2] = {
		{ .addr = (uintptr_t)a.buf + 128, .length = 16, .lkey = a.mr->lkey },
		{ .addr = (uintptr_t)a.buf + 160, .length = 16, .lkey = a.mr->lkey },
	};
	ibv_wr_set_sge_list(a.qpx, 2, two);
	a.qpx->wr_id = 4;
	ibv_wr_send_imm(a.qpx, htonl(0xabcdef01));
	struct ibv_data_buf parts[2] = { { a.buf + 200, 8 }, { a.buf + 240, 4 } };
	ibv_wr_set_inline_data_list(a.qpx, 2, parts);
	CHECK(ibv_wr_complete(a.qpx) == 0, "ibv_wr_complete (batch 1)");

	struct got g[8];
	poll_n(a.cq, 4, g);
	expect(&g[0], 1, IBV_WC_RDMA_WRITE, g[0].byte_len, "WRITE");
	expect(&g[1], 2, IBV_WC_RDMA_WRITE, g[1].byte_len, "WRITE_WITH_IMM");
	expect(&g[2], 3, IBV_WC_SEND, g[2].byte_len, "SEND");
	expect(&g[3], 4, IBV_WC_SEND, g[3].byte_len, "SEND_WITH_IMM");
	CHECK(g[0].qp_num == a.qp->qp_num, "read_qp_num of a send completion: %u", g[0].qp_num);
	poll_n(b.cq, 3, g);
	expect(&g[0], 100, IBV_WC_RECV_RDMA_WITH_IMM, 32, "receive of WRITE_WITH_IMM");
	CHECK(g[0].imm == 0x12345678 && (g[0].wc_flags & IBV_WC_WITH_IMM), "WRITE_WITH_IMM immediate %x", g[0].imm);
	CHECK(g[0].qp_num == b.qp->qp_num, "read_qp_num of a receive: %u", g[0].qp_num);
	expect(&g[1], 101, IBV_WC_RECV, 32, "receive of SEND");
	CHECK(!(g[1].wc_flags & IBV_WC_WITH_IMM), "SEND has no immediate");
	expect(&g[2], 102, IBV_WC_RECV, 12, "receive of SEND_WITH_IMM");
	CHECK(g[2].imm == 0xabcdef01 && (g[2].wc_flags & IBV_WC_WITH_IMM), "SEND_WITH_IMM immediate %x", g[2].imm);
	CHECK(memcmp(b.buf, a.buf, 64) == 0, "WRITE: bytes at the iova");
	CHECK(memcmp(b.buf + 64, a.buf + 64, 32) == 0, "WRITE_WITH_IMM: inline bytes");
	CHECK(memcmp(b.buf + 4096 + 256, a.buf + 128, 16) == 0 &&
	      memcmp(b.buf + 4096 + 256 + 16, a.buf + 160, 16) == 0, "SEND: gathered bytes");
	CHECK(memcmp(b.buf + 4096 + 512, a.buf + 200, 8) == 0 &&
	      memcmp(b.buf + 4096 + 512 + 8, a.buf + 240, 4) == 0, "SEND_WITH_IMM: inline list bytes");

	/* Batch 2: READ and both atomics, at b's iova. */
	for (int i = 0; i < 128; i++)
		b.buf[2048 + i] = (unsigned char)(255 - i);
	uint64_t *faa = (uint64_t *)(b.buf + 3072), *cas = (uint64_t *)(b.buf + 3080);
	*faa = 100;
	*cas = 7;
	ibv_wr_start(a.qpx);
	a.qpx->wr_id = 5;
	ibv_wr_rdma_read(a.qpx, b.mr->rkey, b.base + 2048);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf + 2048, 128);
	a.qpx->wr_id = 6;
	ibv_wr_atomic_fetch_add(a.qpx, b.mr->rkey, b.base + 3072, 5);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf + 3072, 8);
	a.qpx->wr_id = 7;
	ibv_wr_atomic_cmp_swp(a.qpx, b.mr->rkey, b.base + 3080, 7, 9);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf + 3080, 8);
	CHECK(ibv_wr_complete(a.qpx) == 0, "ibv_wr_complete (batch 2)");
	poll_n(a.cq, 3, g);
	expect(&g[0], 5, IBV_WC_RDMA_READ, 128, "READ");
	expect(&g[1], 6, IBV_WC_FETCH_ADD, 8, "FETCH_ADD");
	expect(&g[2], 7, IBV_WC_COMP_SWAP, 8, "CMP_SWP");
	CHECK(memcmp(a.buf + 2048, b.buf + 2048, 128) == 0, "READ: bytes");
	CHECK(*(uint64_t *)(a.buf + 3072) == 100 && *faa == 105, "FETCH_ADD: %llu, now %llu",
	      (unsigned long long)*(uint64_t *)(a.buf + 3072), (unsigned long long)*faa);
	CHECK(*(uint64_t *)(a.buf + 3080) == 7 && *cas == 9, "CMP_SWP: %llu, now %llu",
	      (unsigned long long)*(uint64_t *)(a.buf + 3080), (unsigned long long)*cas);

	/* An aborted batch posts nothing; a batch with a refused opcode posts
	 * nothing and wr_complete says why; the next batch posts normally. */
	post_recv(&b, 103, 4096 + 768, 256);
	ibv_wr_start(a.qpx);
	a.qpx->wr_id = 8;
	ibv_wr_send(a.qpx);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf, 40);
	ibv_wr_abort(a.qpx);
	ibv_wr_start(a.qpx);
	a.qpx->wr_id = 9;
	ibv_wr_send(a.qpx);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf, 50);
	ibv_wr_local_inv(a.qpx, 1234);
	int ret = ibv_wr_complete(a.qpx);
	CHECK(ret == EOPNOTSUPP, "a batch with LOCAL_INV: %d", ret);
	ibv_wr_start(a.qpx);
	a.qpx->wr_id = 10;
	ibv_wr_send(a.qpx);
	ibv_wr_set_sge(a.qpx, a.mr->lkey, (uintptr_t)a.buf, 60);
	CHECK(ibv_wr_complete(a.qpx) == 0, "ibv_wr_complete (after abort)");
	poll_n(a.cq, 1, g);
	expect(&g[0], 10, IBV_WC_SEND, g[0].byte_len, "SEND after abort");
	poll_n(b.cq, 1, g);
	expect(&g[0], 103, IBV_WC_RECV, 60, "only the SEND after the abort arrived");
	struct ibv_poll_cq_attr pattr = {};
	CHECK(ibv_start_poll(a.cq, &pattr) == ENOENT && ibv_start_poll(b.cq, &pattr) == ENOENT,
	      "nothing else completed");

	/* ibv_poll_cq works on an extended CQ too. */
	CHECK(ibv_poll_cq(ibv_cq_ex_to_cq(a.cq), 1, &(struct ibv_wc){0}) == 0, "ibv_poll_cq on a cq_ex");

	struct side *sides[2] = { &a, &b };
	for (int i = 0; i < 2; i++) {
		struct side *s = sides[i];
		CHECK(ibv_destroy_qp(s->qp) == 0 && ibv_destroy_cq(ibv_cq_ex_to_cq(s->cq)) == 0 &&
		      ibv_dereg_mr(s->mr) == 0 && ibv_dealloc_pd(s->pd) == 0 &&
		      ibv_close_device(s->ctx) == 0, "cleanup");
	}
	ibv_free_device_list(list);
	printf("extended verbs OK\n");
	return 0;
}
