/* The drop-in libibverbs' error paths, from C: every check is an entry point given bad input,
 * and the errno (or return value) rdma-core gives for it. Then a poller thread beside a posting
 * thread on one connected pair, with the data checked. It starts with a device another process
 * holds; `errpaths --hold INDEX SECONDS` holds one for scripts/test-dropin.
 *
 * Built by scripts/test-dropin against the system's <infiniband/verbs.h>; run with
 * ERDMA_SOFT_DEVICES=127.0.0.1,127.0.0.2 on the drop-in. Exit 0 when every check holds. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>
#include <infiniband/verbs.h>

static int failures, checks;

/* The drop-in's own (ERDMA_DROPIN_1): binds a soft device's address now. */
int erdma_dropin_bind_device(struct ibv_context *ctx);
/* The drop-in's own (ERDMA_DROPIN_2): a soft device takes in what has arrived now. */
int erdma_dropin_take_in(struct ibv_context *ctx);

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		checks++;                                                    \
		if (!(cond)) {                                               \
			failures++;                                          \
			printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);  \
			printf(__VA_ARGS__);                                 \
			printf(" (errno %d %s)\n", errno, strerror(errno));  \
		}                                                            \
	} while (0)

/* A NULL return with errno `e`. */
#define NULL_ERRNO(expr, e)                                                  \
	do {                                                                 \
		errno = 0;                                                   \
		void *p_ = (void *)(expr);                                   \
		CHECK(p_ == NULL && errno == (e), "%s: want NULL, errno %d", \
		      #expr, e);                                             \
	} while (0)

/* A returned errno `e` (the verbs that return it). */
#define RET(expr, e)                                                         \
	do {                                                                 \
		int r_ = (expr);                                             \
		CHECK(r_ == (e), "%s returned %d, want %d", #expr, r_, e);   \
	} while (0)

static struct ibv_qp *make_qp(struct ibv_pd *pd, struct ibv_cq *cq, struct ibv_qp_init_attr *a)
{
	memset(a, 0, sizeof(*a));
	a->send_cq = cq;
	a->recv_cq = cq;
	a->qp_type = IBV_QPT_RC;
	a->cap.max_send_wr = 64;
	a->cap.max_recv_wr = 64;
	a->cap.max_send_sge = 1;
	a->cap.max_recv_sge = 1;
	return ibv_create_qp(pd, a);
}

static int to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_LOCAL_WRITE };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				   IBV_QP_ACCESS_FLAGS);
}

static int connect_qp(struct ibv_qp *qp, struct ibv_context *peer_ctx, uint32_t peer_qpn)
{
	union ibv_gid gid;
	if (ibv_query_gid(peer_ctx, 1, 1, &gid))
		return -1;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
				 .dest_qp_num = peer_qpn, .rq_psn = 1, .max_dest_rd_atomic = 1,
				 .min_rnr_timer = 12 };
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = 1;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	int r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
					IBV_QP_MIN_RNR_TIMER);
	if (r)
		return r;
	struct ibv_qp_attr s = { .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
				 .rnr_retry = 7, .sq_psn = 1, .max_rd_atomic = 1 };
	return ibv_modify_qp(qp, &s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				      IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

#define MT_WRITES 2000
#define MT_LEN 256

struct mt {
	struct ibv_qp *qp;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	uint64_t raddr;
	uint32_t rkey;
	int completed, errors, post_err, wc_status;
};

static void *poster(void *arg)
{
	struct mt *m = arg;
	for (int i = 0; i < MT_WRITES; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)m->mr->addr + (i % 16) * MT_LEN,
				       .length = MT_LEN, .lkey = m->mr->lkey };
		struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_RDMA_WRITE,
					  .send_flags = IBV_SEND_SIGNALED }, *bad;
		wr.wr.rdma.remote_addr = m->raddr + (i % 16) * MT_LEN;
		wr.wr.rdma.rkey = m->rkey;
		/* At most 64 unpolled (the send queue's depth; the CQ holds more). */
		while (i - __atomic_load_n(&m->completed, __ATOMIC_ACQUIRE) >= 64)
			;
		int r = ibv_post_send(m->qp, &wr, &bad);
		if (r) {
			m->post_err = r;
			__atomic_add_fetch(&m->errors, 1, __ATOMIC_SEQ_CST);
			break;
		}
	}
	return NULL;
}

static void *poller(void *arg)
{
	struct mt *m = arg;
	struct ibv_wc wc[8];
	while (m->completed + __atomic_load_n(&m->errors, __ATOMIC_SEQ_CST) < MT_WRITES) {
		int n = ibv_poll_cq(m->cq, 8, wc);
		if (n < 0) {
			__atomic_add_fetch(&m->errors, 1, __ATOMIC_SEQ_CST);
			m->wc_status = -1;
			return NULL;
		}
		for (int i = 0; i < n; i++) {
			if (wc[i].status != IBV_WC_SUCCESS || wc[i].opcode != IBV_WC_RDMA_WRITE) {
				m->wc_status = wc[i].status;
				__atomic_add_fetch(&m->errors, 1, __ATOMIC_SEQ_CST);
			}
			else
				__atomic_add_fetch(&m->completed, 1, __ATOMIC_RELEASE);
		}
	}
	return NULL;
}

/* Opens device `index` of the list and moves a queue pair on it to RTS (which binds the
 * device's address); 1 when it holds the address, 0 when it could not. */
static int hold_device(int index)
{
	int n = 0;
	struct ibv_device **l = ibv_get_device_list(&n);
	struct ibv_context *c = l && index < n ? ibv_open_device(l[index]) : NULL;
	struct ibv_pd *pd = c ? ibv_alloc_pd(c) : NULL;
	struct ibv_cq *cq = pd ? ibv_create_cq(c, 4, NULL, NULL, 0) : NULL;
	struct ibv_qp_init_attr a;
	struct ibv_qp *qp = cq ? make_qp(pd, cq, &a) : NULL;
	return qp && !to_init(qp) && !connect_qp(qp, c, qp->qp_num);
}

/* The child's half of the shared-address check: holds soft0, says so on `ready`, then holds it
 * until `done` closes. */
static void hold_soft0(int ready, int done)
{
	int ok = hold_device(0);
	char b = ok ? 'y' : 'n';
	if (write(ready, &b, 1) != 1 || read(done, &b, 1) < 0)
		_exit(2);
	_exit(ok ? 0 : 1);
}

/* A device another process uses (its address bound by that process's queue pair) still opens,
 * answers queries, and takes PDs, MRs, CQs and queue pairs (libfabric makes one on every device
 * to learn its limits), as a kernel device does for programs that open every device they list.
 * Only moving a queue pair to RTR needs the address: that fails with EADDRINUSE while the other
 * process holds it, and succeeds once it has gone. */
static void shared_address(void)
{
	int ready[2], done[2];
	if (pipe(ready) || pipe(done)) {
		CHECK(0, "pipe");
		return;
	}
	pid_t child = fork();
	if (child == 0) {
		close(ready[0]);
		close(done[1]);
		hold_soft0(ready[1], done[0]);
	}
	close(ready[1]);
	close(done[0]);
	char b = 0;
	CHECK(child > 0 && read(ready[0], &b, 1) == 1 && b == 'y', "the child holds soft0");
	struct ibv_device **l = ibv_get_device_list(NULL);
	struct ibv_context *c = l ? ibv_open_device(l[0]) : NULL;
	CHECK(c != NULL, "a device another process uses opens");
	struct ibv_port_attr pa;
	struct ibv_pd *pd = c ? ibv_alloc_pd(c) : NULL;
	struct ibv_cq *cq = pd ? ibv_create_cq(c, 4, NULL, NULL, 0) : NULL;
	static char buf[64];
	struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE) : NULL;
	CHECK(c && ibv_query_port(c, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE, "its port");
	CHECK(pd && cq && mr, "its PD, CQ and MR");
	struct ibv_qp_init_attr a;
	struct ibv_qp *qp = cq ? make_qp(pd, cq, &a) : NULL;
	CHECK(qp != NULL, "a queue pair on it");
	if (qp) {
		RET(to_init(qp), 0);
		RET(connect_qp(qp, c, qp->qp_num), EADDRINUSE);
	}
	/* The drop-in librdmacm's way to bind a device it picks fails the same way. */
	if (c)
		RET(erdma_dropin_bind_device(c), EADDRINUSE);
	RET(erdma_dropin_bind_device(NULL), EINVAL);
	RET(erdma_dropin_take_in(NULL), EINVAL);
	close(done[1]);
	int status = -1;
	CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "the child's status %d", status);
	if (qp) {
		RET(connect_qp(qp, c, qp->qp_num), 0); /* the other process has gone */
		RET(erdma_dropin_bind_device(c), 0);   /* bound already: a no-op */
		RET(erdma_dropin_take_in(c), 0);
		RET(ibv_destroy_qp(qp), 0);
	}
	if (mr)
		RET(ibv_dereg_mr(mr), 0);
	if (cq)
		RET(ibv_destroy_cq(cq), 0);
	if (pd)
		RET(ibv_dealloc_pd(pd), 0);
	if (c)
		RET(ibv_close_device(c), 0);
	if (l)
		ibv_free_device_list(l);
	close(ready[0]);
}

int main(int argc, char **argv)
{
	/* `errpaths --hold INDEX SECONDS`: holds a device's address for scripts/test-dropin,
	 * prints "holding <name>" and sleeps. */
	if (argc == 4 && !strcmp(argv[1], "--hold")) {
		int index = atoi(argv[2]);
		struct ibv_device **l = ibv_get_device_list(NULL);
		if (!hold_device(index))
			return 1;
		printf("holding %s\n", ibv_get_device_name(l[index]));
		fflush(stdout);
		sleep(atoi(argv[3]));
		return 0;
	}
	/* First, while this process has no threads to fork beside. */
	shared_address();

	int n = -1;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 2, "two soft devices, got %d", n);
	if (!list || n < 2)
		return 1;
	CHECK(!strcmp(ibv_get_device_name(list[0]), "soft0"), "name %s", ibv_get_device_name(list[0]));
	CHECK(list[2] == NULL, "NULL-terminated");

	/* A device this library did not list: refused (rdma-core would fault). */
	struct ibv_device fake;
	memset(&fake, 0, sizeof(fake));
	NULL_ERRNO(ibv_open_device(&fake), ENODEV);

	struct ibv_context *ctx = ibv_open_device(list[0]), *ctx1 = ibv_open_device(list[1]);
	CHECK(ctx && ctx1, "open");
	if (!ctx || !ctx1)
		return 1;
	CHECK(fcntl(ctx->async_fd, F_GETFD) >= 0, "async_fd is a descriptor");

	/* Queries. */
	struct ibv_port_attr pa;
	RET(ibv_query_port(ctx, 2, &pa), EINVAL);
	RET(ibv_query_port(ctx, 1, &pa), 0);
	CHECK(pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_ETHERNET, "port");
	struct ibv_device_attr da;
	RET(ibv_query_device(ctx, &da), 0);
	struct ibv_device_attr_ex dax;
	struct ibv_query_device_ex_input in = { .comp_mask = 1 };
	RET(ibv_query_device_ex(ctx, &in, &dax), EINVAL);
	in.comp_mask = 0;
	RET(ibv_query_device_ex(ctx, &in, &dax), 0);
	CHECK(dax.orig_attr.max_qp == da.max_qp && da.max_qp > 0, "query_device_ex");
	union ibv_gid gid;
	RET(ibv_query_gid(ctx, 1, da.max_qp, &gid), -1);
	RET(ibv_query_gid(ctx, 1, 1, &gid), 0);
	CHECK(gid.raw[10] == 0xff && gid.raw[11] == 0xff && gid.raw[12] == 127 && gid.raw[15] == 1,
	      "GID 1 is ::ffff:127.0.0.1");
	struct ibv_gid_entry ge;
	RET(ibv_query_gid_ex(ctx, 1, 1, &ge, 0), 0);
	CHECK(ge.gid_type == IBV_GID_TYPE_ROCE_V2, "RoCE v2");
	RET(ibv_query_gid_ex(ctx, 1, 5, &ge, 0), ENODATA);
	RET(ibv_query_gid_ex(ctx, 1, 1, &ge, 1), EINVAL);
	uint16_t pkey;
	RET(ibv_query_pkey(ctx, 1, 1, &pkey), -1);
	RET(ibv_query_pkey(ctx, 1, 0, &pkey), 0);

	/* Memory. */
	struct ibv_pd *pd = ibv_alloc_pd(ctx), *pd1 = ibv_alloc_pd(ctx1);
	CHECK(pd && pd1, "alloc_pd");
	static char buf[16 * MT_LEN], buf1[16 * MT_LEN];
	NULL_ERRNO(ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_REMOTE_WRITE), EINVAL);
	NULL_ERRNO(ibv_reg_mr(pd, buf, sizeof(buf), 1 << 15), EINVAL);
	NULL_ERRNO(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, 3, IBV_ACCESS_LOCAL_WRITE), EOPNOTSUPP);
	NULL_ERRNO(ibv_alloc_mw(pd, IBV_MW_TYPE_1), EOPNOTSUPP);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mr1 = ibv_reg_mr(pd1, buf1, sizeof(buf1),
					IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr && mr1 && mr->lkey && mr->addr == buf && mr->length == sizeof(buf), "reg_mr");

	/* Completion queues and channels. */
	NULL_ERRNO(ibv_create_cq(ctx, 0, NULL, NULL, 0), EINVAL);
	NULL_ERRNO(ibv_create_cq(ctx, da.max_cqe + 1, NULL, NULL, 0), EINVAL);
	NULL_ERRNO(ibv_create_cq(ctx, 16, NULL, NULL, 5), EINVAL);
	struct ibv_cq_init_attr_ex cqx = { .cqe = 16 };
	NULL_ERRNO(ibv_create_cq_ex(ctx, &cqx), EOPNOTSUPP);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch && ch->fd >= 0, "channel");
	struct ibv_cq *ecq = ibv_create_cq(ctx, 16, (void *)0x1234, ch, 0);
	CHECK(ecq != NULL, "cq on a channel");
	RET(ibv_destroy_comp_channel(ch), EBUSY);
	RET(ibv_req_notify_cq(ecq, 0), 0);
	fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
	struct ibv_cq *got;
	void *got_ctx;
	errno = 0;
	RET(ibv_get_cq_event(ch, &got, &got_ctx), -1);
	CHECK(errno == EAGAIN, "no event yet: EAGAIN");
	RET(ibv_destroy_cq(ecq), 0);
	RET(ibv_destroy_comp_channel(ch), 0);
	struct ibv_cq *cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	struct ibv_cq *cq1 = ibv_create_cq(ctx1, 256, NULL, NULL, 0);
	CHECK(cq && cq1, "create_cq");

	/* Queue pairs. */
	struct ibv_qp_init_attr qa;
	make_qp(pd, cq, &qa);
	qa.qp_type = IBV_QPT_UD;
	NULL_ERRNO(ibv_create_qp(pd, &qa), EOPNOTSUPP);
	make_qp(pd, cq, &qa);
	qa.send_cq = NULL;
	NULL_ERRNO(ibv_create_qp(pd, &qa), EINVAL);
	make_qp(pd, cq, &qa);
	qa.cap.max_send_wr = da.max_qp_wr + 1;
	NULL_ERRNO(ibv_create_qp(pd, &qa), EINVAL);
	make_qp(pd, cq, &qa);
	qa.cap.max_send_sge = da.max_sge + 1;
	NULL_ERRNO(ibv_create_qp(pd, &qa), EINVAL);
	NULL_ERRNO(ibv_create_srq(pd, &(struct ibv_srq_init_attr){ .attr = { .max_wr = 1, .max_sge = 1 } }),
		   EOPNOTSUPP);
	struct ibv_qp_init_attr_ex qx = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
					  .comp_mask = IBV_QP_INIT_ATTR_PD |
						       IBV_QP_INIT_ATTR_CREATE_FLAGS,
					  .pd = pd, .cap = { .max_send_wr = 1, .max_recv_wr = 1,
							     .max_send_sge = 1, .max_recv_sge = 1 } };
	NULL_ERRNO(ibv_create_qp_ex(ctx, &qx), EOPNOTSUPP);
	qx.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	qx.send_ops_flags = IBV_QP_EX_WITH_TSO;
	NULL_ERRNO(ibv_create_qp_ex(ctx, &qx), EOPNOTSUPP);

	struct ibv_qp *qp = make_qp(pd, cq, &qa), *qp1 = make_qp(pd1, cq1, &qa);
	CHECK(qp && qp1 && qp->qp_num && qp->state == IBV_QPS_RESET, "create_qp");
	if (!qp || !qp1)
		return 1;
	CHECK(qa.cap.max_send_wr >= 64 && qa.cap.max_recv_wr >= 64, "granted caps written back");

	/* modify_qp: the IBTA's transitions and attribute masks. */
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR };
	RET(ibv_modify_qp(qp, &a, IBV_QP_STATE), EINVAL);         /* RESET -> RTR */
	a.qp_state = IBV_QPS_INIT;
	RET(ibv_modify_qp(qp, &a, IBV_QP_STATE), EINVAL);         /* no port, pkey, access */
	RET(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_QKEY), EINVAL); /* a Q_Key on RC */
	a.port_num = 2;
	RET(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX |
				  IBV_QP_ACCESS_FLAGS), EINVAL);     /* no port 2 */
	CHECK(qp->state == IBV_QPS_RESET, "state unchanged by failures");
	RET(to_init(qp), 0);
	CHECK(qp->state == IBV_QPS_INIT, "state INIT");
	struct ibv_qp_attr qattr;
	struct ibv_qp_init_attr qinit;
	RET(ibv_query_qp(qp, &qattr, IBV_QP_STATE | IBV_QP_CAP, &qinit), 0);
	CHECK(qattr.qp_state == IBV_QPS_INIT && qinit.send_cq == cq, "query_qp");
	struct ibv_qp_attr rtr = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024 };
	RET(ibv_modify_qp(qp, &rtr, IBV_QP_STATE | IBV_QP_PATH_MTU), EINVAL); /* no AV, QPN, PSN */

	/* Posting: bad requests stop the list at themselves. */
	struct ibv_sge sges[8];
	for (int i = 0; i < 8; i++)
		sges[i] = (struct ibv_sge){ .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 1, .sg_list = sges, .num_sge = 8 }, *rbad = NULL;
	RET(ibv_post_recv(qp, &rw, &rbad), EINVAL);
	CHECK(rbad == &rw, "bad recv wr reported");
	RET(to_init(qp1), 0);
	RET(connect_qp(qp, ctx1, qp1->qp_num), 0);
	RET(connect_qp(qp1, ctx, qp->qp_num), 0);
	CHECK(qp->state == IBV_QPS_RTS, "RTS");
	struct ibv_send_wr w2 = { .wr_id = 2, .sg_list = sges, .num_sge = 1,
				  .opcode = IBV_WR_RDMA_WRITE };
	struct ibv_send_wr w1 = { .wr_id = 1, .sg_list = sges, .num_sge = 8,
				  .opcode = IBV_WR_RDMA_WRITE, .next = &w2 }, *sbad = NULL;
	RET(ibv_post_send(qp, &w1, &sbad), EINVAL);
	CHECK(sbad == &w1, "bad send wr reported");
	w1.num_sge = 1;
	w1.opcode = 77;
	w1.next = NULL;
	RET(ibv_post_send(qp, &w1, &sbad), EINVAL);
	w1.opcode = IBV_WR_SEND;
	w1.send_flags = IBV_SEND_INLINE;
	sges[0].length = 4096;
	RET(ibv_post_send(qp, &w1, &sbad), EINVAL); /* inline beyond max_inline_data */
	sges[0].length = MT_LEN;

	/* The extended post API: an inline payload too long fails the batch at wr_complete. */
	struct ibv_qp_ex *qpx = ibv_qp_to_qp_ex(qp);
	CHECK(qpx != NULL, "qp_ex");
	ibv_wr_start(qpx);
	qpx->wr_id = 9;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qpx, mr1->rkey, (uintptr_t)buf1);
	ibv_wr_set_inline_data(qpx, buf, 4096);
	RET(ibv_wr_complete(qpx), EINVAL);
	ibv_wr_start(qpx);
	ibv_wr_bind_mw(qpx, NULL, 0, NULL);
	RET(ibv_wr_complete(qpx), EOPNOTSUPP);

	/* A poller thread beside a posting thread, data checked. */
	for (int i = 0; i < (int)sizeof(buf); i++)
		buf[i] = (char)(i * 7 + 3);
	struct ibv_mr *smr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	struct mt m = { .qp = qp, .cq = cq, .mr = smr, .raddr = (uintptr_t)buf1, .rkey = mr1->rkey };
	pthread_t tp, tq;
	pthread_create(&tq, NULL, poller, &m);
	pthread_create(&tp, NULL, poster, &m);
	pthread_join(tp, NULL);
	pthread_join(tq, NULL);
	CHECK(m.completed == MT_WRITES && m.errors == 0,
	      "%d of %d writes completed, %d errors (post: %d, completion status: %d)", m.completed,
	      MT_WRITES, m.errors, m.post_err, m.wc_status);
	CHECK(!memcmp(buf, buf1, sizeof(buf)), "written bytes arrived");

	/* Asynchronous events: a completion queue too small for what completes on it overruns, and
	 * the context's async_fd (blocking until made otherwise, pollable) reports it. */
	int fl = fcntl(ctx->async_fd, F_GETFL);
	CHECK(fl >= 0 && !(fl & O_NONBLOCK), "async_fd starts blocking");
	fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
	struct ibv_async_event ev;
	errno = 0;
	RET(ibv_get_async_event(ctx, &ev), -1);
	CHECK(errno == EAGAIN, "no event yet: EAGAIN");
	struct ibv_cq *tiny = ibv_create_cq(ctx, 2, NULL, NULL, 0);
	struct ibv_qp *qp2 = make_qp(pd, tiny, &qa), *qp3 = make_qp(pd1, cq1, &qa);
	CHECK(tiny && qp2 && qp3, "second pair");
	if (!tiny || !qp2 || !qp3)
		return 1;
	RET(to_init(qp2), 0);
	RET(to_init(qp3), 0);
	RET(connect_qp(qp2, ctx1, qp3->qp_num), 0);
	RET(connect_qp(qp3, ctx, qp2->qp_num), 0);
	for (int i = 0; i < 32; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = smr->lkey };
		struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_RDMA_WRITE,
					  .send_flags = IBV_SEND_SIGNALED }, *bad;
		wr.wr.rdma.remote_addr = (uintptr_t)buf1;
		wr.wr.rdma.rkey = mr1->rkey;
		if (ibv_post_send(qp2, &wr, &bad))
			break;
	}
	struct pollfd pfd = { .fd = ctx->async_fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 10000) == 1, "async_fd readable after the overrun");
	RET(ibv_get_async_event(ctx, &ev), 0);
	CHECK(ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == tiny, "CQ error event, type %d",
	      ev.event_type);
	ibv_ack_async_event(&ev);
	struct ibv_wc twc[4];
	errno = 0;
	int tn = 0;
	for (int i = 0; i < 100 && tn >= 0; i++)
		tn = ibv_poll_cq(tiny, 4, twc);
	CHECK(tn == -1, "the overrun queue's poll fails");
	RET(ibv_destroy_qp(qp2), 0);
	RET(ibv_destroy_qp(qp3), 0);
	RET(ibv_destroy_cq(tiny), 0);

	RET(ibv_destroy_qp(qp), 0);
	RET(ibv_destroy_qp(qp1), 0);
	RET(ibv_dereg_mr(smr), 0);
	RET(ibv_dereg_mr(mr), 0);
	RET(ibv_dereg_mr(mr1), 0);
	RET(ibv_destroy_cq(cq), 0);
	RET(ibv_destroy_cq(cq1), 0);
	RET(ibv_dealloc_pd(pd), 0);
	RET(ibv_dealloc_pd(pd1), 0);
	RET(ibv_close_device(ctx), 0);
	RET(ibv_close_device(ctx1), 0);
	ibv_free_device_list(list);
	printf("errpaths: %d checks, %d failed\n", checks, failures);
	return failures != 0;
}
