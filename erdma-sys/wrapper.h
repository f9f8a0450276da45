/*
 * Input of the binding generator (build.rs with `--features regenerate`, or
 * scripts/regen-bindings): the three rdma-core headers erdma-sys covers.
 */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/erdma-abi.h>
