/* Registering ordinary heap memory, as programs do, through the drop-in
 * library in process mode (device "a" is tenant alpha's, "b" beta's):
 *
 * 1. Another thread keeps freeing and allocating small heap chunks, and
 *    incrementing a counter in one, while the main thread registers and
 *    deregisters malloc'd buffers beside them 200 times: no increment is
 *    lost and malloc stays sound (glibc aborts on a corrupted free list).
 * 2. After ibv_reg_mr of a malloc'd (not page-aligned) buffer, fork():
 *    the child writes over the buffer and churns the heap, the parent's
 *    bytes and heap are untouched, and b's RDMA WRITE into the parent's
 *    buffer still lands there (its registration survived); the child sees
 *    the buffer as it was at the fork, not the parent's later writes.
 * 3. After ibv_dereg_mr, a child's writes stay the child's as well.
 * 4. One malloc'd buffer registered on both devices: a WRITE through
 *    each device's MR lands in the memory the program reads, also after
 *    the other device's MR is gone.
 *
 * Prints "heap memory OK" and exits 0 when every check holds. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rc.h"

#define LEN 3000 /* not a page multiple: the pages are shared with neighbours */

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	union ibv_gid gid;
};

static struct ibv_device *find(struct ibv_device **list, const char *name)
{
	for (; *list; list++)
		if (strcmp(ibv_get_device_name(*list), name) == 0)
			return *list;
	CHECK(0, "no device %s", name);
	return NULL;
}

static void open_side(struct ibv_device *dev, struct side *s)
{
	s->ctx = ibv_open_device(dev);
	CHECK(s->ctx, "ibv_open_device");
	s->pd = ibv_alloc_pd(s->ctx);
	CHECK(s->pd, "ibv_alloc_pd");
	s->cq = ibv_create_cq(s->ctx, 16, NULL, NULL, 0);
	CHECK(s->cq, "ibv_create_cq");
	struct ibv_qp_init_attr qa = {
		.send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	s->qp = ibv_create_qp(s->pd, &qa);
	CHECK(s->qp, "ibv_create_qp");
	CHECK(ibv_query_gid(s->ctx, 1, 0, &s->gid) == 0, "ibv_query_gid");
}

/* The heap churner of part 1. */
static atomic_int stop;
static volatile uint64_t *counter;

static void *churn(void *arg)
{
	uint64_t *n = arg;
	void *keep[64] = { 0 };
	unsigned i = 0;
	while (!atomic_load(&stop)) {
		*counter = *counter + 1;
		(*n)++;
		free(keep[i % 64]);
		keep[i % 64] = malloc(16 + (i * 37) % 200);
		CHECK(keep[i % 64], "malloc in the churner");
		i++;
	}
	for (i = 0; i < 64; i++)
		free(keep[i]);
	return NULL;
}

static void writes_of_other_threads_are_kept(struct side *a)
{
	counter = malloc(sizeof(*counter));
	CHECK(counter, "malloc");
	*counter = 0;
	uint64_t n = 0;
	pthread_t t;
	CHECK(pthread_create(&t, NULL, churn, &n) == 0, "pthread_create");
	for (int round = 0; round < 200; round++) {
		unsigned char *buf = malloc(LEN);
		CHECK(buf, "malloc");
		memset(buf, round, LEN);
		struct ibv_mr *mr = ibv_reg_mr(a->pd, buf, LEN, IBV_ACCESS_LOCAL_WRITE);
		CHECK(mr, "ibv_reg_mr round %d", round);
		CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr round %d", round);
		for (int i = 0; i < LEN; i++)
			CHECK(buf[i] == (unsigned char)round, "round %d: byte %d changed", round, i);
		free(buf);
	}
	atomic_store(&stop, 1);
	CHECK(pthread_join(t, NULL) == 0, "pthread_join");
	CHECK(*counter == n, "another thread's increments were lost: %llu of %llu",
	      (unsigned long long)*counter, (unsigned long long)n);
	printf("a thread's %llu heap increments and frees during 200 reg/dereg: none lost\n",
	       (unsigned long long)n);
	free((void *)counter);
}

/* Forks a child that checks `buf` holds `seen` in every byte, fills it
 * with 0xcc and churns the heap, then exits 0; the parent writes `later`
 * over the buffer once the child has started, and reaps it. */
static void fork_and_scribble(unsigned char *buf, unsigned char seen, unsigned char later)
{
	int go[2], started[2];
	CHECK(pipe(go) == 0 && pipe(started) == 0, "pipe");
	pid_t child = fork();
	CHECK(child >= 0, "fork");
	if (child == 0) {
		char c = 0;
		/* Waits for the parent's write, then looks. */
		if (write(started[1], &c, 1) != 1 || read(go[0], &c, 1) != 1)
			_exit(2);
		for (int i = 0; i < LEN; i++)
			if (buf[i] != seen)
				_exit(3);
		memset(buf, 0xcc, LEN);
		for (int i = 0; i < 1000; i++)
			free(malloc(16 + i % 300));
		_exit(0);
	}
	char c = 0;
	CHECK(read(started[0], &c, 1) == 1, "the child started");
	memset(buf, later, LEN);
	CHECK(write(go[1], &c, 1) == 1, "signal the child");
	int status = 0;
	CHECK(waitpid(child, &status, 0) == child, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "the child saw other bytes than at the fork (status %#x)", status);
	for (int i = 0; i < LEN; i++)
		CHECK(buf[i] == later, "the child's write reached the parent at byte %d", i);
	close(go[0]), close(go[1]), close(started[0]), close(started[1]);
}

static void poll_one(struct ibv_cq *cq, const char *what)
{
	struct ibv_wc wc;
	time_t deadline = time(NULL) + 10;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		CHECK(time(NULL) < deadline, "%s: no completion in 10 s", what);
	CHECK(n == 1 && wc.status == IBV_WC_SUCCESS, "%s: status %d", what, wc.status);
}

/* `from` WRITEs `len` bytes of `value` into `mr` (at `at`) through its QP. */
static void write_into(struct side *from, struct ibv_mr *mr, unsigned char *at, size_t len,
		       unsigned char value, const char *what)
{
	unsigned char *src = aligned_alloc(4096, 4096);
	CHECK(src && len <= 4096, "aligned_alloc");
	memset(src, value, len);
	struct ibv_mr *smr = ibv_reg_mr(from->pd, src, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(smr, "%s: ibv_reg_mr of the source", what);
	struct ibv_sge sge = { .addr = (uintptr_t)src, .length = len, .lkey = smr->lkey };
	struct ibv_send_wr wr = {
		.wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
		.send_flags = IBV_SEND_SIGNALED,
		.wr.rdma = { .remote_addr = (uintptr_t)at, .rkey = mr->rkey },
	}, *bad;
	CHECK(ibv_post_send(from->qp, &wr, &bad) == 0, "%s: ibv_post_send", what);
	poll_one(from->cq, what);
	CHECK(ibv_dereg_mr(smr) == 0, "%s: ibv_dereg_mr of the source", what);
	free(src);
	for (size_t i = 0; i < len; i++)
		CHECK(at[i] == value, "%s: byte %zu is %#x, not %#x", what, i, at[i], value);
}

static void a_child_gets_its_own_copy(struct side *a, struct side *b)
{
	unsigned char *buf = malloc(LEN);
	void *neighbour = malloc(100);
	CHECK(buf && neighbour, "malloc");
	memset(buf, 0x11, LEN);
	memset(neighbour, 0x77, 100);
	struct ibv_mr *mr = ibv_reg_mr(a->pd, buf, LEN,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr, "ibv_reg_mr");
	fork_and_scribble(buf, 0x11, 0x22);

	/* b writes into the parent's buffer: the registration survived. */
	write_into(b, mr, buf, LEN, 0x5a, "b's WRITE after the fork");
	for (int i = 0; i < 100; i++)
		CHECK(((unsigned char *)neighbour)[i] == 0x77, "a neighbouring chunk changed");
	printf("after fork: the child's writes stayed its own, b's WRITE reached the parent\n");

	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
	fork_and_scribble(buf, 0x5a, 0x33);
	printf("after dereg: the child's writes stayed its own\n");
	free(neighbour);
	free(buf);
}

static void one_buffer_on_both_devices(struct side *a, struct side *b)
{
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	unsigned char *buf = malloc(LEN);
	CHECK(buf, "malloc");
	memset(buf, 0, LEN);
	struct ibv_mr *on_a = ibv_reg_mr(a->pd, buf, LEN, access);
	struct ibv_mr *on_b = ibv_reg_mr(b->pd, buf, LEN, access);
	CHECK(on_a && on_b, "ibv_reg_mr of one buffer on both devices");
	write_into(b, on_a, buf, 1000, 0xa1, "b's WRITE through a's MR");
	write_into(a, on_b, buf + 1000, 1000, 0xb2, "a's WRITE through b's MR");
	CHECK(ibv_dereg_mr(on_a) == 0, "ibv_dereg_mr on a");
	write_into(a, on_b, buf + 2000, 1000, 0xc3, "a's WRITE through b's MR, a's gone");
	CHECK(buf[0] == 0xa1 && buf[1000] == 0xb2, "earlier WRITEs lost");
	CHECK(ibv_dereg_mr(on_b) == 0, "ibv_dereg_mr on b");
	CHECK(buf[0] == 0xa1 && buf[1000] == 0xb2 && buf[2999] == 0xc3, "bytes lost at dereg");
	printf("one buffer on both devices: every WRITE landed where the program reads\n");
	free(buf);
}

int main(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list, "ibv_get_device_list");
	struct side a, b;
	open_side(find(list, "a"), &a);
	open_side(find(list, "b"), &b);
	rc_connect(a.qp, b.qp->qp_num, b.gid, IBV_ACCESS_REMOTE_WRITE, 1);
	rc_connect(b.qp, a.qp->qp_num, a.gid, IBV_ACCESS_REMOTE_WRITE, 1);

	writes_of_other_threads_are_kept(&a);
	a_child_gets_its_own_copy(&a, &b);
	one_buffer_on_both_devices(&a, &b);

	ibv_destroy_qp(a.qp), ibv_destroy_qp(b.qp);
	ibv_destroy_cq(a.cq), ibv_destroy_cq(b.cq);
	ibv_dealloc_pd(a.pd), ibv_dealloc_pd(b.pd);
	ibv_close_device(a.ctx), ibv_close_device(b.ctx);
	ibv_free_device_list(list);
	printf("heap memory OK\n");
	return 0;
}
