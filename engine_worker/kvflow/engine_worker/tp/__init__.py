"""Tensor parallelism across processes: rank 0 (the worker) leads, the others follow its plan."""
