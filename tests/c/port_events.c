/* What each context of a vrdma device sees when its port goes down (hostd,
 * the host's datapath, went away). Built against Debian's
 * <infiniband/verbs.h> and libibverbs by tests/tests/port_events.rs and
 * run on the drop-in library.
 *
 *   port_events N   opens the first device N times, makes an RC QP (with
 *                   its PD and CQ) on context 0, prints "ready" and
 *                   then, for each context in turn, waits for one async
 *                   event and prints "context I: EVENT port P", then
 *                   queries port 1 of each and prints "context I: state S"
 *                   (S from ibv_port_state_str), then tries to create a
 *                   CQ on context 0 and prints "create_cq: errno E" (or
 *                   "create_cq: created"), queries the QP and prints
 *                   "qp state S" (S from enum ibv_qp_state), and destroys
 *                   the QP, CQ and PD, printing "destroyed".
 *
 * Exits 0 when every call succeeded; otherwise prints what failed and
 * exits 1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#define MAX_CONTEXTS 8

static void fail(const char *what)
{
	printf("FAIL %s\n", what);
	exit(1);
}

int main(int argc, char **argv)
{
	struct ibv_context *ctx[MAX_CONTEXTS];
	struct ibv_device **list;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	int n, i;

	setvbuf(stdout, NULL, _IOLBF, 0);
	n = argc > 1 ? atoi(argv[1]) : 2;
	if (n < 1 || n > MAX_CONTEXTS)
		fail("context count");
	list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		fail("ibv_get_device_list");
	for (i = 0; i < n; i++) {
		ctx[i] = ibv_open_device(list[0]);
		if (!ctx[i])
			fail("ibv_open_device");
	}
	{
		struct ibv_qp_init_attr init = {
			.qp_type = IBV_QPT_RC,
			.cap = { .max_send_wr = 4, .max_recv_wr = 4,
				 .max_send_sge = 1, .max_recv_sge = 1 },
		};

		pd = ibv_alloc_pd(ctx[0]);
		if (!pd)
			fail("ibv_alloc_pd");
		cq = ibv_create_cq(ctx[0], 16, NULL, NULL, 0);
		if (!cq)
			fail("ibv_create_cq");
		init.send_cq = cq;
		init.recv_cq = cq;
		qp = ibv_create_qp(pd, &init);
		if (!qp)
			fail("ibv_create_qp");
	}
	printf("ready\n");
	for (i = 0; i < n; i++) {
		struct ibv_async_event event;

		if (ibv_get_async_event(ctx[i], &event))
			fail("ibv_get_async_event");
		printf("context %d: %s port %d\n", i,
		       ibv_event_type_str(event.event_type),
		       event.element.port_num);
		ibv_ack_async_event(&event);
	}
	for (i = 0; i < n; i++) {
		struct ibv_port_attr attr;

		if (ibv_query_port(ctx[i], 1, &attr))
			fail("ibv_query_port");
		printf("context %d: state %s\n", i,
		       ibv_port_state_str(attr.state));
	}
	{
		struct ibv_cq *more;
		struct ibv_qp_attr attr;
		struct ibv_qp_init_attr init;

		errno = 0;
		more = ibv_create_cq(ctx[0], 16, NULL, NULL, 0);
		if (more) {
			printf("create_cq: created\n");
			ibv_destroy_cq(more);
		} else {
			printf("create_cq: errno %d\n", errno);
		}
		if (ibv_query_qp(qp, &attr, IBV_QP_STATE, &init))
			fail("ibv_query_qp");
		printf("qp state %d\n", attr.qp_state);
		if (ibv_destroy_qp(qp) || ibv_destroy_cq(cq) ||
		    ibv_dealloc_pd(pd))
			fail("destroy");
		printf("destroyed\n");
	}
	for (i = 0; i < n; i++)
		if (ibv_close_device(ctx[i]))
			fail("ibv_close_device");
	ibv_free_device_list(list);
	return 0;
}
