"""Tensor parallelism across processes: the process groups and the all-reduce (``parallel_state``)."""
