/*
 * Connects and disconnects an RC connection through rdma_cm N times, one
 * after the other, as a connection-heavy service does (a client per
 * request): every cycle creates an ID, resolves the server's address and
 * route, creates a QP, connects, SENDs one checked message, disconnects
 * and destroys everything. Prints the cycles per second.
 *
 *   cm_cycles -s -p PORT -n N         server: serves N connections, exits
 *   cm_cycles -c ADDR -p PORT -n N    client
 *   cm_cycles -c ADDR -p PORT -n N -w client that, for a test to read the
 *       device's counters, prints "warm" after one cycle more and waits
 *       for a line on stdin, then prints "done" after the N cycles and
 *       waits for the end of stdin before it exits
 *   -t TOS, -a TIMEOUT (client): rdma_set_option RDMA_OPTION_ID_TOS and
 *       RDMA_OPTION_ID_ACK_TIMEOUT on each ID before its route is resolved
 *   -q: each side prints its first connection's QP as ibv_query_qp sees
 *       it: "<side>: tclass N timeout N"
 *
 * Exit status 0 only if every cycle completed and every message arrived
 * intact.
 */
#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MSG 64

static struct rdma_event_channel *channel;
static int tos = -1, ack_timeout = -1, query;

/* Registered buffers live on their own page (as perftest's do), not on
 * the stack. */
static char buf[4096] __attribute__((aligned(4096)));

/* The next CM event, which must be `want` (for `id`, unless NULL). */
static int expect(enum rdma_cm_event_type want, struct rdma_cm_id *id,
		  struct rdma_cm_event **out)
{
	struct rdma_cm_event *ev;

	if (rdma_get_cm_event(channel, &ev)) {
		perror("rdma_get_cm_event");
		return -1;
	}
	if (ev->event != want || (id && ev->id != id)) {
		fprintf(stderr, "expected %s, got %s (status %d)\n",
			rdma_event_str(want), rdma_event_str(ev->event),
			ev->status);
		rdma_ack_cm_event(ev);
		return -1;
	}
	if (out)
		*out = ev;
	else
		rdma_ack_cm_event(ev);
	return 0;
}

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr a;

	memset(&a, 0, sizeof(a));
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = 4;
	a.cap.max_recv_wr = 4;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.sq_sig_all = 1;
	return a;
}

static int wait_wc(struct ibv_cq *cq, enum ibv_wc_opcode op)
{
	struct ibv_wc wc;
	int n;

	do
		n = ibv_poll_cq(cq, 1, &wc);
	while (n == 0);
	if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.opcode != op) {
		fprintf(stderr, "completion: n %d status %s opcode %d\n", n,
			n > 0 ? ibv_wc_status_str(wc.status) : "-", n > 0 ? (int)wc.opcode : -1);
		return -1;
	}
	return 0;
}

/* With -q, the first connection's QP as the device reports it. */
static int report_qp(const char *side, struct rdma_cm_id *id, int cycle)
{
	struct ibv_qp_init_attr init;
	struct ibv_qp_attr a;

	if (!query || cycle)
		return 0;
	if (ibv_query_qp(id->qp, &a, IBV_QP_AV | IBV_QP_TIMEOUT, &init)) {
		perror("ibv_query_qp");
		return -1;
	}
	printf("%s: tclass %d timeout %d\n", side, a.ah_attr.grh.traffic_class, a.timeout);
	fflush(stdout);
	return 0;
}

/* With -t and -a, the options every client ID gets. */
static int set_options(struct rdma_cm_id *id)
{
	uint8_t v;

	if (tos >= 0) {
		v = tos;
		if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &v, sizeof(v))) {
			perror("rdma_set_option TOS");
			return -1;
		}
	}
	if (ack_timeout >= 0) {
		v = ack_timeout;
		if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &v, sizeof(v))) {
			perror("rdma_set_option ACK_TIMEOUT");
			return -1;
		}
	}
	return 0;
}

static void pattern(char *to, int cycle)
{
	memset(to, 0, MSG);
	snprintf(to, MSG, "cm_cycles message %d", cycle);
}

static int serve(int port, int n)
{
	struct rdma_cm_id *listener, *id;
	struct rdma_cm_event *ev;
	struct sockaddr_in addr;
	char want[MSG];
	struct ibv_mr *mr;
	int i;

	if (rdma_create_id(channel, &listener, NULL, RDMA_PS_TCP)) {
		perror("rdma_create_id");
		return 1;
	}
	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_port = htons(port);
	if (rdma_bind_addr(listener, (struct sockaddr *)&addr) ||
	    rdma_listen(listener, 16)) {
		perror("bind/listen");
		return 1;
	}
	for (i = 0; i < n; i++) {
		struct ibv_qp_init_attr a = qp_attr();

		if (expect(RDMA_CM_EVENT_CONNECT_REQUEST, NULL, &ev))
			return 1;
		id = ev->id;
		rdma_ack_cm_event(ev);
		if (rdma_create_qp(id, NULL, &a)) {
			perror("rdma_create_qp");
			return 1;
		}
		mr = rdma_reg_msgs(id, buf, MSG);
		if (!mr || rdma_post_recv(id, NULL, buf, MSG, mr)) {
			perror("receive buffer");
			return 1;
		}
		if (rdma_accept(id, NULL)) {
			perror("rdma_accept");
			return 1;
		}
		if (expect(RDMA_CM_EVENT_ESTABLISHED, id, NULL) ||
		    report_qp("server", id, i) ||
		    wait_wc(id->recv_cq, IBV_WC_RECV))
			return 1;
		pattern(want, i);
		if (memcmp(buf, want, MSG)) {
			fprintf(stderr, "cycle %d: received \"%.*s\"\n", i, MSG, buf);
			return 1;
		}
		if (expect(RDMA_CM_EVENT_DISCONNECTED, id, NULL))
			return 1;
		rdma_dereg_mr(mr);
		rdma_destroy_qp(id);
		rdma_destroy_id(id);
	}
	rdma_destroy_id(listener);
	printf("server: %d connections served\n", n);
	return 0;
}

static int connect_once(struct sockaddr_in *dst, int cycle)
{
	struct ibv_qp_init_attr a = qp_attr();
	struct rdma_conn_param param;
	struct rdma_cm_id *id;
	struct ibv_mr *mr;

	if (rdma_create_id(channel, &id, NULL, RDMA_PS_TCP)) {
		perror("rdma_create_id");
		return -1;
	}
	if (set_options(id) ||
	    rdma_resolve_addr(id, NULL, (struct sockaddr *)dst, 2000) ||
	    expect(RDMA_CM_EVENT_ADDR_RESOLVED, id, NULL) ||
	    rdma_resolve_route(id, 2000) ||
	    expect(RDMA_CM_EVENT_ROUTE_RESOLVED, id, NULL))
		return -1;
	if (rdma_create_qp(id, NULL, &a)) {
		perror("rdma_create_qp");
		return -1;
	}
	memset(&param, 0, sizeof(param));
	param.retry_count = 7;
	param.rnr_retry_count = 7;
	if (rdma_connect(id, &param) ||
	    expect(RDMA_CM_EVENT_ESTABLISHED, id, NULL) ||
	    report_qp("client", id, cycle))
		return -1;
	pattern(buf, cycle);
	mr = rdma_reg_msgs(id, buf, MSG);
	if (!mr || rdma_post_send(id, NULL, buf, MSG, mr, 0) ||
	    wait_wc(id->send_cq, IBV_WC_SEND))
		return -1;
	if (rdma_disconnect(id) || expect(RDMA_CM_EVENT_DISCONNECTED, id, NULL))
		return -1;
	rdma_dereg_mr(mr);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
	return 0;
}

int main(int argc, char **argv)
{
	struct sockaddr_in dst;
	struct timespec t0, t1;
	const char *server = NULL;
	int op, port = 0, n = 1, listen = 0, pause = 0, i;
	char line[16];
	double s;

	while ((op = getopt(argc, argv, "sc:p:n:wt:a:q")) != -1) {
		switch (op) {
		case 's': listen = 1; break;
		case 'c': server = optarg; break;
		case 'p': port = atoi(optarg); break;
		case 'n': n = atoi(optarg); break;
		case 'w': pause = 1; break;
		case 't': tos = atoi(optarg); break;
		case 'a': ack_timeout = atoi(optarg); break;
		case 'q': query = 1; break;
		default: return 2;
		}
	}
	channel = rdma_create_event_channel();
	if (!channel) {
		perror("rdma_create_event_channel");
		return 1;
	}
	if (listen)
		return serve(port, n);
	if (!server)
		return 2;
	memset(&dst, 0, sizeof(dst));
	dst.sin_family = AF_INET;
	dst.sin_port = htons(port);
	if (inet_pton(AF_INET, server, &dst.sin_addr) != 1)
		return 2;
	if (pause) {
		if (connect_once(&dst, 0)) {
			fprintf(stderr, "warm-up cycle failed\n");
			return 1;
		}
		printf("warm\n");
		fflush(stdout);
		if (!fgets(line, sizeof(line), stdin))
			return 1;
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (i = 0; i < n; i++) {
		/* Numbered as the server counts them, the warm-up 0. */
		if (connect_once(&dst, i + pause)) {
			fprintf(stderr, "cycle %d failed\n", i);
			return 1;
		}
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
	printf("client: %d cycles in %.3f s (%.0f connections/s)\n", n, s, n / s);
	if (pause) {
		printf("done\n");
		fflush(stdout);
		while (fgets(line, sizeof(line), stdin))
			;
	}
	rdma_destroy_event_channel(channel);
	return 0;
}
