/* Error paths and outcomes of the drop-in librdmacm.so.1, through the system's <rdma/rdma_cma.h>:
 * every check asserts an exact return value, errno, event type, status or byte content.
 * Needs ERDMA_SOFT_DEVICES=127.0.0.1,127.0.0.2 and a private network namespace (only lo up);
 * scripts/test-dropin builds and runs it. With the argument "die PORT" it connects to
 * 127.0.0.1:PORT and exits without disconnecting (the vanished peer of one check). */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
#include <rdma/rsocket.h>

extern char **environ;
static int fails, passes;

#define CHECK(cond, ...) do { if (cond) { passes++; } else { fails++; \
    fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); \
    fprintf(stderr, " (errno %d %s)\n", errno, strerror(errno)); } } while (0)
#define FAILS_WITH(call, e) do { errno = 0; int rc_ = (call); \
    CHECK(rc_ == -1 && errno == (e), "%s: rc %d, want -1 errno %d", #call, rc_, (e)); } while (0)

static struct sockaddr_in addr4(const char *ip, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	inet_pton(AF_INET, ip, &a.sin_addr);
	return a;
}

/* The next event within `ms`, or NULL. */
static struct rdma_cm_event *next_event(struct rdma_event_channel *ch, int ms)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *ev = NULL;
	if (poll(&p, 1, ms) != 1 || rdma_get_cm_event(ch, &ev))
		return NULL;
	return ev;
}

/* Expects an event of `type` (and `status` unless -1000) on `ch`; returns it unacked. */
static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type type,
				   int status, const char *what)
{
	struct rdma_cm_event *ev = next_event(ch, 15000);
	CHECK(ev && ev->event == type && (status == -1000 || ev->status == status),
	      "%s: got %s status %d, want %s status %d", what,
	      ev ? rdma_event_str(ev->event) : "nothing", ev ? ev->status : 0,
	      rdma_event_str(type), status);
	return ev;
}

static void ack(struct rdma_cm_event *ev)
{
	if (ev)
		rdma_ack_cm_event(ev);
}

/* Destroys an identifier on a thread of its own, and says when that returned. */
struct destroyer {
	struct rdma_cm_id *id;
	int done;
};

static void *destroy_thread(void *arg)
{
	struct destroyer *d = arg;
	rdma_destroy_id(d->id);
	__atomic_store_n(&d->done, 1, __ATOMIC_SEQ_CST);
	return NULL;
}

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.cap.max_send_wr = a.cap.max_recv_wr = 8;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 1;
	return a;
}

/* An active identifier on `ch`, resolved towards 127.0.0.1:port, with a QP. */
static struct rdma_cm_id *active(struct rdma_event_channel *ch, int port)
{
	struct rdma_cm_id *id = NULL;
	struct sockaddr_in dst = addr4("127.0.0.1", port);
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "create_id");
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) == 0, "resolve_addr");
	ack(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, 0, "resolve_addr"));
	CHECK(rdma_resolve_route(id, 2000) == 0, "resolve_route");
	ack(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, 0, "resolve_route"));
	struct ibv_qp_init_attr a = qp_attr();
	CHECK(rdma_create_qp(id, NULL, &a) == 0, "create_qp (the id's PD, CQs made)");
	CHECK(id->send_cq && id->recv_cq && id->send_cq_channel, "the id's own CQs");
	return id;
}

/* Moves a queue pair the program made itself with rdma_init_qp_attr's attributes. */
static int move_own(struct rdma_cm_id *id, struct ibv_qp *qp, enum ibv_qp_state state)
{
	struct ibv_qp_attr a;
	int mask;
	memset(&a, 0, sizeof a);
	a.qp_state = state;
	if (rdma_init_qp_attr(id, &a, &mask))
		return -1;
	return ibv_modify_qp(qp, &a, mask);
}

static int die_mode(int port)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *id = active(ch, port);
	CHECK(rdma_connect(id, NULL) == 0, "connect");
	ack(expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "established (the dying peer)"));
	_exit(fails ? 1 : 0); /* no disconnect, no destroy */
}

int main(int argc, char **argv)
{
	if (argc == 3 && !strcmp(argv[1], "die"))
		return die_mode(atoi(argv[2]));
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_event_channel *sch = rdma_create_event_channel();
	CHECK(ch && sch, "create_event_channel");
	struct rdma_cm_id *id = NULL, *id2 = NULL, *lid = NULL;

	/* Arguments. */
	FAILS_WITH(rdma_create_id(ch, NULL, NULL, RDMA_PS_TCP), EINVAL);
	FAILS_WITH(rdma_create_id(ch, &id, NULL, RDMA_PS_UDP), EOPNOTSUPP);
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "create_id");
	struct sockaddr_in6 v6 = { .sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT };
	FAILS_WITH(rdma_bind_addr(id, (struct sockaddr *)&v6), EAFNOSUPPORT);
	struct sockaddr_in nodev = addr4("192.0.2.1", 0); /* not this host's */
	FAILS_WITH(rdma_bind_addr(id, (struct sockaddr *)&nodev), EADDRNOTAVAIL);
	/* A loopback address no device has gets a device, as with the kernel's rdma_cm. */
	struct rdma_cm_id *lo = NULL;
	struct sockaddr_in lo9 = addr4("127.0.0.9", 0);
	CHECK(rdma_create_id(ch, &lo, NULL, RDMA_PS_TCP) == 0, "create_id");
	CHECK(lo && rdma_bind_addr(lo, (struct sockaddr *)&lo9) == 0, "bind_addr 127.0.0.9");
	CHECK(lo && lo->verbs && !strncmp(ibv_get_device_name(lo->verbs->device), "soft", 4),
	      "a loopback identifier's device");
	CHECK(lo && ((struct sockaddr_in *)rdma_get_local_addr(lo))->sin_addr.s_addr ==
			    lo9.sin_addr.s_addr,
	      "it keeps its address");
	if (lo)
		CHECK(rdma_destroy_id(lo) == 0, "destroy_id");
	FAILS_WITH(rdma_resolve_addr(id, NULL, NULL, 2000), EINVAL);
	FAILS_WITH(rdma_connect(id, NULL), EINVAL);
	FAILS_WITH(rdma_accept(id, NULL), EINVAL);
	FAILS_WITH(rdma_disconnect(id), EINVAL);
	struct ibv_qp_attr qa; int qm;
	qa.qp_state = IBV_QPS_RTR;
	FAILS_WITH(rdma_init_qp_attr(id, &qa, &qm), EINVAL);
	uint8_t tos = 8; int tos4 = 8;
	CHECK(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, 1) == 0, "set_option TOS");
	FAILS_WITH(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos4, 4), EINVAL);
	FAILS_WITH(rdma_join_multicast(id, (struct sockaddr *)&nodev, NULL), EOPNOTSUPP);
	CHECK(rdma_destroy_id(id) == 0, "destroy_id");
	FAILS_WITH(rdma_destroy_id(id), EINVAL); /* a destroyed identifier is refused, not used */
	FAILS_WITH(rsocket(AF_INET, SOCK_STREAM, 0), EOPNOTSUPP);
	CHECK(!strcmp(rdma_event_str(RDMA_CM_EVENT_ESTABLISHED), "RDMA_CM_EVENT_ESTABLISHED") &&
	      !strcmp(rdma_event_str(99), "UNKNOWN EVENT"), "event_str");

	/* A non-blocking channel with nothing in it. */
	fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
	struct rdma_cm_event *ev = NULL;
	FAILS_WITH(rdma_get_cm_event(ch, &ev), EAGAIN);

	/* Addresses. */
	struct rdma_addrinfo hints, *res = NULL;
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	CHECK(rdma_getaddrinfo("127.0.0.1", "7999", &hints, &res) == 0 && res && res->ai_src_addr &&
	      ntohs(((struct sockaddr_in *)res->ai_src_addr)->sin_port) == 7999, "getaddrinfo passive");
	rdma_freeaddrinfo(res);
	hints.ai_port_space = RDMA_PS_UDP;
	FAILS_WITH(rdma_getaddrinfo("127.0.0.1", "7999", &hints, &res), EOPNOTSUPP);
	hints.ai_port_space = RDMA_PS_TCP;
	hints.ai_flags = RAI_NUMERICHOST;
	FAILS_WITH(rdma_getaddrinfo("localhost", "7999", &hints, &res), EINVAL);

	/* Unreachable: nothing routes 10.255.255.1 in this namespace. */
	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "create_id");
	struct sockaddr_in far = addr4("10.255.255.1", 7000);
	CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&far, 2000) == 0, "resolve_addr (far)");
	struct rdma_cm_event *unacked = expect(ch, RDMA_CM_EVENT_ADDR_ERROR, -ENETUNREACH,
					       "unreachable address");
	/* rdma_destroy_id waits until the identifier's events are acknowledged, as rdma-core's
	 * does: an event thread is back waiting before its main thread destroys the channel. */
	struct destroyer d = { .id = id };
	pthread_t dt;
	CHECK(pthread_create(&dt, NULL, destroy_thread, &d) == 0, "destroyer thread");
	usleep(200 * 1000);
	CHECK(!__atomic_load_n(&d.done, __ATOMIC_SEQ_CST),
	      "rdma_destroy_id returned before the event was acknowledged");
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ack(unacked);
	pthread_join(dt, NULL);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	/* Released by the acknowledgement, not by the wait's 2 s limit. */
	double waited = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
	CHECK(waited < 1.0, "rdma_destroy_id returned %.3f s after the ack", waited);

	/* Nobody listening: REJECTED with IB_CM_REJ_INVALID_SERVICE_ID (8). */
	id = active(ch, 7001);
	CHECK(rdma_connect(id, NULL) == 0, "connect");
	ack(expect(ch, RDMA_CM_EVENT_REJECTED, 8, "no listener"));
	rdma_destroy_qp(id);
	rdma_destroy_id(id);

	/* A listener; two identifiers cannot hold one port. */
	struct sockaddr_in la = addr4("127.0.0.1", 7002);
	CHECK(rdma_create_id(sch, &lid, NULL, RDMA_PS_TCP) == 0, "create_id (listener)");
	CHECK(rdma_bind_addr(lid, (struct sockaddr *)&la) == 0, "bind_addr");
	CHECK(rdma_create_id(sch, &id2, NULL, RDMA_PS_TCP) == 0, "create_id");
	FAILS_WITH(rdma_bind_addr(id2, (struct sockaddr *)&la), EADDRINUSE);
	rdma_destroy_id(id2);
	CHECK(rdma_listen(lid, 8) == 0, "listen");
	CHECK(ntohs(rdma_get_src_port(lid)) == 7002, "get_src_port");

	/* Rejected, with private data both ways; oversized private data refused. */
	char big[256];
	memset(big, 'x', sizeof big);
	id = active(ch, 7002);
	struct rdma_conn_param cp;
	memset(&cp, 0, sizeof cp);
	cp.private_data = big;
	cp.private_data_len = 57;
	FAILS_WITH(rdma_connect(id, &cp), EINVAL);
	cp.private_data = "hello";
	cp.private_data_len = 5;
	CHECK(rdma_connect(id, &cp) == 0, "connect");
	ev = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request");
	if (ev) {
		CHECK(ev->listen_id == lid && ev->param.conn.private_data_len == 56 &&
		      !memcmp(ev->param.conn.private_data, "hello", 5), "request's private data");
		struct rdma_cm_id *cid = ev->id;
		ack(ev);
		FAILS_WITH(rdma_reject(cid, big, 149), EINVAL);
		CHECK(rdma_reject(cid, "no thanks", 9) == 0, "reject");
		rdma_destroy_id(cid);
	}
	ev = expect(ch, RDMA_CM_EVENT_REJECTED, 28, "rejected");
	if (ev) {
		CHECK(ev->param.conn.private_data_len >= 9 &&
		      !memcmp(ev->param.conn.private_data, "no thanks", 9), "rejection's private data");
		ack(ev);
	}
	rdma_destroy_qp(id);
	rdma_destroy_id(id);

	/* Accepted: private data, a SEND with its bytes intact, a disconnect seen on both sides. */
	id = active(ch, 7002);
	CHECK(rdma_connect(id, NULL) == 0, "connect");
	ev = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request");
	struct rdma_cm_id *cid = ev ? ev->id : NULL;
	ack(ev);
	if (cid) {
		struct ibv_qp_init_attr a = qp_attr();
		CHECK(rdma_create_qp(cid, NULL, &a) == 0, "create_qp (passive)");
		char rbuf[64] = {0};
		struct ibv_mr *rmr = rdma_reg_msgs(cid, rbuf, sizeof rbuf);
		CHECK(rmr && rdma_post_recv(cid, NULL, rbuf, sizeof rbuf, rmr) == 0, "post_recv");
		memset(&cp, 0, sizeof cp);
		cp.private_data = big;
		cp.private_data_len = 197;
		FAILS_WITH(rdma_accept(cid, &cp), EINVAL);
		cp.private_data = "welcome";
		cp.private_data_len = 7;
		CHECK(rdma_accept(cid, &cp) == 0, "accept");
		ev = expect(ch, RDMA_CM_EVENT_ESTABLISHED, 0, "established (active)");
		if (ev) {
			CHECK(ev->param.conn.private_data_len >= 7 &&
			      !memcmp(ev->param.conn.private_data, "welcome", 7), "accept's private data");
			ack(ev);
		}
		ack(expect(sch, RDMA_CM_EVENT_ESTABLISHED, 0, "established (passive)"));
		char msg[] = "bytes intact through rdma_cm";
		struct ibv_mr *smr = rdma_reg_msgs(id, msg, sizeof msg);
		CHECK(smr && rdma_post_send(id, NULL, msg, sizeof msg, smr, 0) == 0, "post_send");
		struct ibv_wc wc;
		CHECK(rdma_get_send_comp(id, &wc) == 1 && wc.status == IBV_WC_SUCCESS, "send completion");
		CHECK(rdma_get_recv_comp(cid, &wc) == 1 && wc.status == IBV_WC_SUCCESS &&
		      wc.byte_len == sizeof msg && !memcmp(rbuf, msg, sizeof msg), "received bytes");
		CHECK(rdma_disconnect(id) == 0, "disconnect");
		ack(expect(sch, RDMA_CM_EVENT_DISCONNECTED, 0, "disconnected (passive)"));
		ack(expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "disconnected (active)"));
		CHECK(rdma_disconnect(cid) == 0, "disconnect after the peer's");
		rdma_dereg_mr(smr);
		rdma_dereg_mr(rmr);
		rdma_destroy_qp(cid);
		rdma_destroy_id(cid);
	}
	rdma_destroy_qp(id);
	rdma_destroy_id(id);

	/* Queue pairs the programs move themselves (rdma_init_qp_attr, CONNECT_RESPONSE,
	 * rdma_establish), as cmtime does: bytes intact all the same. */
	{
		struct rdma_cm_id *a_id = NULL, *p_id = NULL;
		struct sockaddr_in dst = addr4("127.0.0.1", 7002);
		CHECK(rdma_create_id(ch, &a_id, NULL, RDMA_PS_TCP) == 0, "create_id");
		CHECK(rdma_resolve_addr(a_id, NULL, (struct sockaddr *)&dst, 2000) == 0, "resolve");
		ack(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, 0, "resolve"));
		CHECK(rdma_resolve_route(a_id, 2000) == 0, "route");
		ack(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, 0, "route"));
		struct ibv_cq *acq = ibv_create_cq(a_id->verbs, 8, NULL, NULL, 0);
		struct ibv_qp_init_attr ia = qp_attr();
		ia.send_cq = ia.recv_cq = acq;
		struct ibv_qp *aqp = acq ? ibv_create_qp(a_id->pd, &ia) : NULL;
		CHECK(aqp && move_own(a_id, aqp, IBV_QPS_INIT) == 0, "own QP to INIT (active)");
		memset(&cp, 0, sizeof cp);
		FAILS_WITH(rdma_connect(a_id, &cp), EINVAL); /* neither a QP nor a qp_num */
		cp.qp_num = aqp ? aqp->qp_num : 0;
		CHECK(rdma_connect(a_id, &cp) == 0, "connect with qp_num");
		ev = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request (own QP)");
		p_id = ev ? ev->id : NULL;
		ack(ev);
		struct ibv_cq *pcq = p_id ? ibv_create_cq(p_id->verbs, 8, NULL, NULL, 0) : NULL;
		ia = qp_attr();
		ia.send_cq = ia.recv_cq = pcq;
		struct ibv_qp *pqp = pcq ? ibv_create_qp(p_id->pd, &ia) : NULL;
		CHECK(pqp && move_own(p_id, pqp, IBV_QPS_INIT) == 0 &&
		      move_own(p_id, pqp, IBV_QPS_RTR) == 0 && move_own(p_id, pqp, IBV_QPS_RTS) == 0,
		      "own QP to RTS (passive)");
		char rbuf[32] = {0};
		struct ibv_mr *rmr = pqp ? ibv_reg_mr(p_id->pd, rbuf, sizeof rbuf, IBV_ACCESS_LOCAL_WRITE) : NULL;
		struct ibv_sge rsge = { (uintptr_t)rbuf, sizeof rbuf, rmr ? rmr->lkey : 0 };
		struct ibv_recv_wr rwr = { .sg_list = &rsge, .num_sge = 1 }, *bad_r;
		CHECK(rmr && ibv_post_recv(pqp, &rwr, &bad_r) == 0, "post_recv (own QP)");
		memset(&cp, 0, sizeof cp);
		cp.qp_num = pqp ? pqp->qp_num : 0;
		CHECK(p_id && rdma_accept(p_id, &cp) == 0, "accept with qp_num");
		ack(expect(ch, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, "connect response"));
		CHECK(move_own(a_id, aqp, IBV_QPS_RTR) == 0 && move_own(a_id, aqp, IBV_QPS_RTS) == 0,
		      "own QP to RTS (active)");
		CHECK(rdma_establish(a_id) == 0, "establish");
		ack(expect(sch, RDMA_CM_EVENT_ESTABLISHED, 0, "established (passive, own QP)"));
		char msg[] = "moved by hand";
		struct ibv_mr *smr = ibv_reg_mr(a_id->pd, msg, sizeof msg, 0);
		struct ibv_sge ssge = { (uintptr_t)msg, sizeof msg, smr ? smr->lkey : 0 };
		struct ibv_send_wr swr = { .sg_list = &ssge, .num_sge = 1, .opcode = IBV_WR_SEND,
					   .send_flags = IBV_SEND_SIGNALED }, *bad_s;
		CHECK(smr && ibv_post_send(aqp, &swr, &bad_s) == 0, "post_send (own QP)");
		struct ibv_wc wc;
		int n = 0;
		for (int spin = 0; spin < 5000000 && n == 0; spin++)
			n = ibv_poll_cq(pcq, 1, &wc);
		CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && wc.byte_len == sizeof msg &&
		      !memcmp(rbuf, msg, sizeof msg), "received bytes (own QP)");
		CHECK(rdma_disconnect(a_id) == 0, "disconnect");
		ack(expect(sch, RDMA_CM_EVENT_DISCONNECTED, 0, "disconnected (own QP)"));
		ack(expect(ch, RDMA_CM_EVENT_DISCONNECTED, 0, "disconnected (own QP, active)"));
		ibv_dereg_mr(smr);
		ibv_dereg_mr(rmr);
		ibv_destroy_qp(aqp);
		ibv_destroy_qp(pqp);
		ibv_destroy_cq(acq);
		ibv_destroy_cq(pcq);
		rdma_destroy_id(a_id);
		rdma_destroy_id(p_id);
	}

	/* A peer process that exits without disconnecting: DISCONNECTED all the same. */
	pid_t pid;
	char *args[] = { argv[0], "die", "7002", NULL };
	setenv("ERDMA_SOFT_DEVICES", "127.0.0.3", 1); /* this process holds .1 and .2 */
	CHECK(posix_spawn(&pid, argv[0], NULL, NULL, args, environ) == 0, "spawn");
	ev = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST, 0, "request (dying peer)");
	cid = ev ? ev->id : NULL;
	ack(ev);
	if (cid) {
		struct ibv_qp_init_attr a = qp_attr();
		CHECK(rdma_create_qp(cid, NULL, &a) == 0 && rdma_accept(cid, NULL) == 0, "accept");
		ack(expect(sch, RDMA_CM_EVENT_ESTABLISHED, 0, "established (dying peer)"));
		ack(expect(sch, RDMA_CM_EVENT_DISCONNECTED, 0, "the vanished peer noticed"));
		rdma_destroy_qp(cid);
		rdma_destroy_id(cid);
	}
	int wst = 0;
	waitpid(pid, &wst, 0);
	CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "the dying peer's own checks");

	/* Synchronous endpoints: a refused connect is ECONNREFUSED. */
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	CHECK(rdma_getaddrinfo("127.0.0.1", "7003", &hints, &res) == 0, "getaddrinfo active");
	struct ibv_qp_init_attr a = qp_attr();
	CHECK(rdma_create_ep(&id, res, NULL, &a) == 0 && id->qp, "create_ep");
	FAILS_WITH(rdma_connect(id, NULL), ECONNREFUSED);
	rdma_destroy_ep(id);
	rdma_freeaddrinfo(res);

	rdma_destroy_id(lid);
	rdma_destroy_event_channel(ch);
	rdma_destroy_event_channel(sch);

	/* A channel the program has destroyed: rping's event thread asks one for its next event
	 * as the main thread exits. rdma-core reads its closed descriptor and fails with EBADF;
	 * so does this library, without reading the freed object. */
	FAILS_WITH(rdma_get_cm_event(ch, &ev), EBADF);
	FAILS_WITH(rdma_create_id(sch, &id, NULL, RDMA_PS_TCP), EBADF);
	CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) == 0, "create_id (synchronous)");
	FAILS_WITH(rdma_migrate_id(id, ch), EBADF);
	rdma_destroy_id(id);

	/* Addresses from the hints alone (no node, no service), as libfabric resolves. */
	struct sockaddr_in hsrc = addr4("127.0.0.2", 0), hdst = addr4("127.0.0.1", 7004);
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	hints.ai_src_addr = (struct sockaddr *)&hsrc;
	hints.ai_src_len = sizeof hsrc;
	hints.ai_dst_addr = (struct sockaddr *)&hdst;
	hints.ai_dst_len = sizeof hdst;
	CHECK(rdma_getaddrinfo(NULL, NULL, &hints, &res) == 0 && res && res->ai_dst_addr &&
	      ((struct sockaddr_in *)res->ai_dst_addr)->sin_port == htons(7004) &&
	      res->ai_src_addr &&
	      ((struct sockaddr_in *)res->ai_src_addr)->sin_addr.s_addr == hsrc.sin_addr.s_addr,
	      "getaddrinfo from the hints' addresses");
	rdma_freeaddrinfo(res);
	hints.ai_flags = RAI_PASSIVE;
	CHECK(rdma_getaddrinfo(NULL, NULL, &hints, &res) == 0 && res && res->ai_src_addr &&
	      ((struct sockaddr_in *)res->ai_src_addr)->sin_addr.s_addr == hsrc.sin_addr.s_addr,
	      "passive getaddrinfo from the hints' source");
	rdma_freeaddrinfo(res);
	memset(&hints, 0, sizeof hints);
	FAILS_WITH(rdma_getaddrinfo(NULL, NULL, &hints, &res), EINVAL);
	printf("%d checks passed, %d failed\n", passes, fails);
	return fails != 0;
}
