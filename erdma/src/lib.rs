//! erdma: safe RDMA for Alibaba Cloud eRDMA and any verbs device, with a userspace software device.
