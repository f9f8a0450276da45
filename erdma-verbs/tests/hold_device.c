/* Holds a soft device's address for the drop-in tests: opens device `argv[1]` (an index into
 * the list), moves a queue pair to RTR (which binds the address), prints "holding <name>", and
 * sleeps `argv[2]` seconds. Exit 0 once it held the address, 1 if it could not. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <infiniband/verbs.h>

int main(int argc, char **argv)
{
	if (argc != 3)
		return 2;
	int n = 0, i = atoi(argv[1]);
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || i < 0 || i >= n)
		return 1;
	struct ibv_context *c = ibv_open_device(l[i]);
	struct ibv_pd *pd = c ? ibv_alloc_pd(c) : NULL;
	struct ibv_cq *cq = pd ? ibv_create_cq(c, 4, NULL, NULL, 0) : NULL;
	struct ibv_qp_init_attr a = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				      .cap = { .max_send_wr = 4, .max_recv_wr = 4,
					       .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *qp = cq ? ibv_create_qp(pd, &a) : NULL;
	union ibv_gid gid;
	if (!qp || ibv_query_gid(c, 1, 1, &gid))
		return 1;
	struct ibv_qp_attr init = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	struct ibv_qp_attr rtr = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
				   .dest_qp_num = qp->qp_num, .rq_psn = 1, .max_dest_rd_atomic = 1,
				   .min_rnr_timer = 12 };
	rtr.ah_attr.is_global = 1;
	rtr.ah_attr.grh.dgid = gid;
	rtr.ah_attr.grh.sgid_index = 1;
	rtr.ah_attr.grh.hop_limit = 1;
	rtr.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					     IBV_QP_ACCESS_FLAGS) ||
	    ibv_modify_qp(qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
					    IBV_QP_MIN_RNR_TIMER))
		return 1;
	printf("holding %s\n", ibv_get_device_name(l[i]));
	fflush(stdout);
	sleep(atoi(argv[2]));
	return 0;
}
