"""NCCL's watchdog settings for KV pair groups: a dead or timed-out peer costs one transfer,
never the worker (torch_dist.py describes the groups)."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as _dist

log = logging.getLogger(__name__)
# torch.distributed's stubs do not export ProcessGroupNCCL.
dist: Any = _dist

# torch reads these as each ProcessGroupNCCL forms (names as of torch 2.15; the older
# NCCL_* spellings are aliases torch still reads, which these override).
NCCL_WATCHDOG_ENV = {
    # 2 = CleanUpOnly: on an NCCL error or timeout the watchdog aborts that communicator and
    # fails its work, and the process lives. The default (3, SkipCleanUp) and 1 (TearDown)
    # rethrow in the watchdog thread, which terminates the worker.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The heartbeat monitor aborts the process when the watchdog stalls for
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, e.g. inside ncclCommAbort of a communicator whose
    # peer is gone. Liveness (liveness.py, the pod's probe) judges a stuck worker instead.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # The watchdog rethrows CUDA errors it meets (terminating the process), and a timeout
    # can tear it down too. A real device fault also fails the engine's own next kernel,
    # which the worker reports and its probe sees; a peer's fault must not end this one.
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "TORCH_NCCL_TEARDOWN_ON_TIMEOUT": "0",
    # wait() stays non-blocking: the host polls completion against the transfer's own
    # deadline and raises TransferTimeoutError itself (pipeline.wait_work).
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # No flight-recorder dump and no error broadcast through the store on a timeout: a
    # failed transfer is routine here (the request prefills locally).
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
}


def apply_nccl_watchdog_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set NCCL_WATCHDOG_ENV in ``environ`` (process-wide: the model's tensor-parallel groups
    formed later get the same, and their failures then fail steps instead of the process).
    A different value set by hand is overridden, and logged: it would let a peer's death
    kill this worker."""
    for name, value in NCCL_WATCHDOG_ENV.items():
        old = environ.get(name)
        if old is not None and old != value:
            log.warning("%s=%s overridden to %s: a dead KV peer must not end this worker",
                        name, old, value)  # fmt: skip
        environ[name] = value


def nccl_options(timeout_s: float) -> Any:
    """A pair group's NCCL options: its watchdog's timeout is the transfer's deadline."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=max(timeout_s, 0.001))
    return options
