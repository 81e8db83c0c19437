/* What one open context of a vrdma device sees when hostd (the host's
 * datapath, the device's NIC) restarts: the port goes down and comes back
 * up, as on a link flap. Built against Debian's <infiniband/verbs.h> and
 * libibverbs by tests/tests/port_events.rs and run on the drop-in library.
 *
 *   port_flap flap   opens the first device once, makes a PD, a 4 KiB MR,
 *                    a CQ and an RC QP connected to itself (RTS), prints
 *                    "gid G" (G its port's GID 0) and "ready"; then prints
 *                    the async events as they come: "event E" (E from
 *                    ibv_event_type_str; "qp=mine" after a QP event of
 *                    that QP) until IBV_EVENT_PORT_ERR and
 *                    IBV_EVENT_QP_FATAL have come. With the port down it
 *                    prints "state S" (ibv_port_state_str), "qp state N"
 *                    (enum ibv_qp_state), tries a CQ ("create_cq: errno
 *                    E"), posts a SEND on the failed QP ("posted"); then
 *                    prints events until IBV_EVENT_PORT_ACTIVE, and
 *                    "state S", "gid G", "qp state N", "wc status N" (the
 *                    SEND's completion). Then a new QP on the same PD, MR
 *                    and CQ: prints "qp Q G" and reads the peer's "qp Q G"
 *                    line from stdin, connects to it, SENDs 4 KiB of the
 *                    pattern i * 7 + 1 and prints "sent" after its
 *                    completion.
 *   port_flap recv   opens the first device, makes the same objects and an
 *                    RC QP, prints "qp Q G", reads the peer's "qp Q G"
 *                    line, connects, posts a receive of 4 KiB and prints
 *                    "received N bytes, pattern ok" (or what differs).
 *
 * Exits 0 when every call succeeded; otherwise prints what failed and
 * exits 1. */
#include <arpa/inet.h>
#include "rc.h"

#define SIZE 4096

struct objects {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	struct ibv_cq *cq;
	char *buf;
};

static void open_objects(struct objects *o)
{
	struct ibv_device **list = ibv_get_device_list(NULL);

	CHECK(list && list[0], "ibv_get_device_list");
	o->ctx = ibv_open_device(list[0]);
	CHECK(o->ctx, "ibv_open_device");
	ibv_free_device_list(list);
	o->pd = ibv_alloc_pd(o->ctx);
	CHECK(o->pd, "ibv_alloc_pd");
	o->buf = calloc(1, SIZE);
	CHECK(o->buf, "calloc");
	o->mr = ibv_reg_mr(o->pd, o->buf, SIZE, IBV_ACCESS_LOCAL_WRITE);
	CHECK(o->mr, "ibv_reg_mr");
	o->cq = ibv_create_cq(o->ctx, 16, NULL, NULL, 0);
	CHECK(o->cq, "ibv_create_cq");
}

static struct ibv_qp *new_qp(struct objects *o)
{
	struct ibv_qp_init_attr init = {
		.send_cq = o->cq,
		.recv_cq = o->cq,
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4,
			 .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(o->pd, &init);

	CHECK(qp, "ibv_create_qp");
	return qp;
}

static union ibv_gid gid_of(struct objects *o)
{
	union ibv_gid gid;

	CHECK(ibv_query_gid(o->ctx, 1, 0, &gid) == 0, "ibv_query_gid");
	return gid;
}

static const char *show(union ibv_gid gid, char *text)
{
	CHECK(inet_ntop(AF_INET6, gid.raw, text, INET6_ADDRSTRLEN), "inet_ntop");
	return text;
}

/* Prints "qp Q G" for `qp`, reads the peer's line and returns its QPN and
 * GID. */
static uint32_t exchange(struct objects *o, struct ibv_qp *qp, union ibv_gid *peer)
{
	char text[INET6_ADDRSTRLEN], theirs[INET6_ADDRSTRLEN + 1];
	unsigned int qpn;

	printf("qp %u %s\n", qp->qp_num, show(gid_of(o), text));
	CHECK(scanf(" qp %u %46s", &qpn, theirs) == 2, "the peer's qp line");
	CHECK(inet_pton(AF_INET6, theirs, peer->raw) == 1, "the peer's GID");
	return qpn;
}

static struct ibv_wc wait_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	int n;

	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	CHECK(n == 1, "ibv_poll_cq");
	return wc;
}

static void post_send(struct objects *o, struct ibv_qp *qp, uint64_t wr_id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)o->buf, .length = SIZE, .lkey = o->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad;

	CHECK(ibv_post_send(qp, &wr, &bad) == 0, "ibv_post_send");
}

/* Prints async events until one of type `until` came. */
static void events_until(struct objects *o, struct ibv_qp *mine, enum ibv_event_type until)
{
	for (;;) {
		struct ibv_async_event event;
		enum ibv_event_type type;

		CHECK(ibv_get_async_event(o->ctx, &event) == 0, "ibv_get_async_event");
		type = event.event_type;
		if (type == IBV_EVENT_QP_FATAL)
			printf("event %s qp=%s\n", ibv_event_type_str(type),
			       event.element.qp == mine ? "mine" : "other");
		else
			printf("event %s\n", ibv_event_type_str(type));
		ibv_ack_async_event(&event);
		if (type == until)
			return;
	}
}

static void print_states(struct objects *o, struct ibv_qp *qp)
{
	struct ibv_port_attr port;
	struct ibv_qp_attr attr;
	struct ibv_qp_init_attr init;

	CHECK(ibv_query_port(o->ctx, 1, &port) == 0, "ibv_query_port");
	printf("state %s\n", ibv_port_state_str(port.state));
	CHECK(ibv_query_qp(qp, &attr, IBV_QP_STATE, &init) == 0, "ibv_query_qp");
	printf("qp state %d\n", attr.qp_state);
}

static void flap(void)
{
	struct objects o;
	struct ibv_qp *qp, *fresh;
	union ibv_gid peer;
	uint32_t dest;
	char text[INET6_ADDRSTRLEN];
	struct ibv_wc wc;
	int i;

	open_objects(&o);
	qp = new_qp(&o);
	rc_connect(qp, qp->qp_num, gid_of(&o), 0, 1);
	printf("gid %s\nready\n", show(gid_of(&o), text));
	events_until(&o, qp, IBV_EVENT_PORT_ERR);
	events_until(&o, qp, IBV_EVENT_QP_FATAL);
	print_states(&o, qp);
	{
		struct ibv_cq *more;

		errno = 0;
		more = ibv_create_cq(o.ctx, 16, NULL, NULL, 0);
		if (more) {
			printf("create_cq: created\n");
			ibv_destroy_cq(more);
		} else {
			printf("create_cq: errno %d\n", errno);
		}
	}
	post_send(&o, qp, 7);
	printf("posted\n");
	events_until(&o, qp, IBV_EVENT_PORT_ACTIVE);
	print_states(&o, qp);
	printf("gid %s\n", show(gid_of(&o), text));
	wc = wait_wc(o.cq);
	printf("wc status %d wr_id %llu\n", wc.status, (unsigned long long)wc.wr_id);

	fresh = new_qp(&o);
	dest = exchange(&o, fresh, &peer);
	rc_connect(fresh, dest, peer, 0, 1);
	for (i = 0; i < SIZE; i++)
		o.buf[i] = (char)(i * 7 + 1);
	post_send(&o, fresh, 8);
	wc = wait_wc(o.cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 8, "SEND: status %d", wc.status);
	printf("sent\n");
	CHECK(ibv_destroy_qp(fresh) == 0 && ibv_destroy_qp(qp) == 0, "ibv_destroy_qp");
}

static void recv_side(void)
{
	struct objects o;
	struct ibv_qp *qp;
	union ibv_gid peer;
	uint32_t dest;
	struct ibv_sge sge;
	struct ibv_recv_wr wr = { .wr_id = 9, .sg_list = &sge, .num_sge = 1 }, *bad;
	struct ibv_wc wc;
	int i;

	open_objects(&o);
	qp = new_qp(&o);
	dest = exchange(&o, qp, &peer);
	sge = (struct ibv_sge){ .addr = (uintptr_t)o.buf, .length = SIZE, .lkey = o.mr->lkey };
	rc_connect(qp, dest, peer, 0, 1);
	/* The sender retries until the receive is there (rnr_retry 7). */
	CHECK(ibv_post_recv(qp, &wr, &bad) == 0, "ibv_post_recv");
	wc = wait_wc(o.cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 9, "RECV: status %d", wc.status);
	for (i = 0; i < SIZE; i++)
		CHECK(o.buf[i] == (char)(i * 7 + 1), "byte %d is %d", i, o.buf[i]);
	printf("received %u bytes, pattern ok\n", wc.byte_len);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc > 1 && !strcmp(argv[1], "flap"))
		flap();
	else if (argc > 1 && !strcmp(argv[1], "recv"))
		recv_side();
	else
		CHECK(0, "usage: port_flap flap|recv");
	return 0;
}
