/* Contexts of one vrdma device, as RDMA programs make them: one process
 * that opens the device several times, or several processes that each
 * open it. Built against Debian's <infiniband/verbs.h> and libibverbs by
 * tests/tests/contexts.rs and run on the drop-in library.
 *
 *   contexts many N        opens the device N times in this process; a QP
 *                          of context i writes to context (i+1) % N
 *                          through the device's GID, every context at once,
 *                          ROUNDS times; prints "N contexts OK".
 *   contexts alone ID SECS opens it once: two QPs of the context write to
 *                          each other for SECS seconds; prints "running"
 *                          after the first round, then "ID OK rounds=R".
 *                          A refused QP prints "quota errno E" and exits 3.
 *
 * Every WRITE's bytes are checked where they land. Exits 0 only when
 * every check held; otherwise prints what failed and exits 1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>

#include "rc.h"


#define LEN 4096
#define ROUNDS 50
#define MAX_CONTEXTS 64

struct end {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	unsigned char *buf; /* [0, LEN): what it sends; [LEN, 2 LEN): what lands */
	union ibv_gid gid;
};

static void open_end(struct ibv_device *dev, struct end *e)
{
	e->ctx = ibv_open_device(dev);
	CHECK(e->ctx, "ibv_open_device");
	e->pd = ibv_alloc_pd(e->ctx);
	CHECK(e->pd, "ibv_alloc_pd");
	e->cq = ibv_create_cq(e->ctx, 64, NULL, NULL, 0);
	CHECK(e->cq, "ibv_create_cq");
	e->buf = calloc(2, LEN);
	CHECK(e->buf, "calloc");
	e->mr = ibv_reg_mr(e->pd, e->buf, 2 * LEN,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(e->mr, "ibv_reg_mr");
	CHECK(ibv_query_gid(e->ctx, 1, 0, &e->gid) == 0, "ibv_query_gid");
}

/* An RC QP on `e`, or NULL with errno (a quota). */
static struct ibv_qp *new_qp(struct end *e)
{
	struct ibv_qp_init_attr a = {
		.send_cq = e->cq, .recv_cq = e->cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return ibv_create_qp(e->pd, &a);
}

/* Connects `qp` to QP `dest` of the device with `gid`. */
static void connect_qp(struct ibv_qp *qp, uint32_t dest, union ibv_gid gid)
{
	rc_connect(qp, dest, gid, IBV_ACCESS_REMOTE_WRITE, 1);
}

/* Posts a WRITE of `from`'s first LEN bytes, stamped with (tag, round),
 * into the second half of `to`'s buffer. */
static void post_write(struct ibv_qp *qp, struct end *from, struct end *to, int tag, int round)
{
	for (int i = 0; i < LEN; i++)
		from->buf[i] = (unsigned char)(tag * 31 + round * 7 + i);
	struct ibv_sge sge = { .addr = (uintptr_t)from->buf, .length = LEN, .lkey = from->mr->lkey };
	struct ibv_send_wr wr = {
		.wr_id = (uint64_t)tag << 32 | (uint32_t)round, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
		.wr.rdma = { .remote_addr = (uintptr_t)to->buf + LEN, .rkey = to->mr->rkey },
	}, *bad;
	CHECK(ibv_post_send(qp, &wr, &bad) == 0, "ibv_post_send");
}

/* Waits (10 s at most) for one successful completion on `e`'s CQ. */
static void completed(struct end *e)
{
	struct ibv_wc wc;
	time_t until = time(NULL) + 10;
	int n;
	while ((n = ibv_poll_cq(e->cq, 1, &wc)) == 0)
		CHECK(time(NULL) < until, "no completion within 10 s");
	CHECK(n == 1 && wc.status == IBV_WC_SUCCESS, "completion status %d", wc.status);
}

/* The bytes a WRITE stamped (tag, round) landed in `to`. */
static void landed(struct end *to, int tag, int round)
{
	for (int i = 0; i < LEN; i++)
		CHECK(to->buf[LEN + i] == (unsigned char)(tag * 31 + round * 7 + i),
		      "byte %d of write (%d, %d)", i, tag, round);
}

static int many(struct ibv_device *dev, int n)
{
	static struct end ends[MAX_CONTEXTS];
	static struct ibv_qp *qps[MAX_CONTEXTS], *peers[MAX_CONTEXTS];
	CHECK(n >= 2 && n <= MAX_CONTEXTS, "N from 2 to %d", MAX_CONTEXTS);
	for (int i = 0; i < n; i++)
		open_end(dev, &ends[i]);
	for (int i = 0; i < n; i++) {
		CHECK(memcmp(&ends[i].gid, &ends[0].gid, sizeof(ends[0].gid)) == 0,
		      "context %d has another GID", i);
		qps[i] = new_qp(&ends[i]);       /* writes to context i + 1 */
		CHECK(qps[i], "ibv_create_qp in context %d", i);
		peers[i] = new_qp(&ends[i]);     /* the target of context i - 1 */
		CHECK(peers[i], "ibv_create_qp (peer) in context %d", i);
	}
	for (int i = 0; i < n; i++) {
		int next = (i + 1) % n, prev = (i + n - 1) % n;
		connect_qp(qps[i], peers[next]->qp_num, ends[next].gid);
		connect_qp(peers[i], qps[prev]->qp_num, ends[prev].gid);
	}
	for (int r = 0; r < ROUNDS; r++) {
		for (int i = 0; i < n; i++)
			post_write(qps[i], &ends[i], &ends[(i + 1) % n], i, r);
		for (int i = 0; i < n; i++)
			completed(&ends[i]);
		for (int i = 0; i < n; i++)
			landed(&ends[(i + 1) % n], i, r);
	}
	for (int i = 0; i < n; i++) {
		CHECK(ibv_destroy_qp(qps[i]) == 0 && ibv_destroy_qp(peers[i]) == 0, "destroy QPs");
		CHECK(ibv_dereg_mr(ends[i].mr) == 0 && ibv_destroy_cq(ends[i].cq) == 0 &&
		      ibv_dealloc_pd(ends[i].pd) == 0 && ibv_close_device(ends[i].ctx) == 0,
		      "close context %d", i);
	}
	printf("%d contexts OK\n", n);
	return 0;
}

static int alone(struct ibv_device *dev, int id, int secs)
{
	struct end e;
	open_end(dev, &e);
	struct ibv_qp *a = new_qp(&e);
	struct ibv_qp *b = a ? new_qp(&e) : NULL;
	if (!a || !b) {
		printf("quota errno %d\n", errno);
		return 3;
	}
	connect_qp(a, b->qp_num, e.gid);
	connect_qp(b, a->qp_num, e.gid);
	time_t until = time(NULL) + secs;
	int rounds = 0;
	do {
		post_write(rounds % 2 ? a : b, &e, &e, id, rounds);
		completed(&e);
		landed(&e, id, rounds);
		if (++rounds == 1) {
			printf("running\n");
			fflush(stdout);
		}
	} while (time(NULL) < until);
	printf("%d OK rounds=%d\n", id, rounds);
	return 0;
}

int main(int argc, char **argv)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1, "one device (got %d)", n);
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 3 && strcmp(argv[1], "many") == 0)
		return many(list[0], atoi(argv[2]));
	if (argc == 4 && strcmp(argv[1], "alone") == 0)
		return alone(list[0], atoi(argv[2]), atoi(argv[3]));
	printf("usage: contexts many N | contexts alone ID SECS\n");
	return 2;
}
