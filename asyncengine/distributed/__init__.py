"""Tensor parallelism over torch.distributed: process groups, worker processes, the driver."""
