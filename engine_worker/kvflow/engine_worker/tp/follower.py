"""A tensor-parallel rank other than 0: load a slice of the model, then run rank 0's plans.

Started by rank 0 (``leader.py``) as ``python -m kvflow.engine_worker.tp.follower`` with the
worker's settings, its rank and the store's port in the environment. It has no scheduler,
no server and no sampler: each step it receives the plan, drops the state of the requests
that ended, and runs its slice of the forward pass, whose sums and gather meet rank 0's.

It exits 0 when rank 0 says stop, and non-zero when rank 0 is gone (its plans' group
fails, or its parent process is no longer the worker) or a step fails here: rank 0's next
collective then fails, and its health names this rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

from kvflow.engine_worker.settings import WorkerSettings
from kvflow.engine_worker.tp.group import connect_store, join
from kvflow.engine_worker.tp.leader import PORT_ENV, RANK_ENV, SETTINGS_ENV, threads_per_rank
from kvflow.proto.otel import TracingConfig

log = logging.getLogger("kvflow.worker.tp")
_PARENT_CHECK_S = 1.0


def settings_from_json(text: str) -> WorkerSettings:
    fields = json.loads(text)
    fields["tracing"] = TracingConfig(**fields["tracing"])
    return WorkerSettings(**fields)


def _exit_with_parent(parent: int) -> None:
    """A rank whose worker died (SIGKILL: no stop plan) exits rather than linger."""
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(3)


def main() -> int:
    rank = int(os.environ[RANK_ENV])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    settings = settings_from_json(os.environ[SETTINGS_ENV])
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if not settings.device.startswith("cuda"):
        torch.set_num_threads(threads_per_rank(settings.tensor_parallel_size))
    else:
        from kvflow.engine_worker.tp.leader import rank_device

        torch.cuda.set_device(torch.device(rank_device(settings.device, rank)))

    from kvflow.engine_worker.torch_worker import load_weights_for, make_runner

    store = connect_store(int(os.environ[PORT_ENV]))
    group = join(
        store, rank, settings.tensor_parallel_size, cuda=settings.device.startswith("cuda")
    )
    model, config, dtype = load_weights_for(settings, None, tp=group.ranks)
    runner = make_runner(settings, model, config, dtype, rank=rank).runner
    group.mark_ready()
    log.info("ready: following rank 0's plans")
    while True:
        try:
            plan = group.plans.receive()
        except RuntimeError as err:
            log.error("rank 0 is gone (%s): exiting", err)
            return 2
        if plan.is_stop:
            log.info("rank 0 stopped: exiting")
            return 0
        for request_id in plan.released:
            runner.release(request_id)
        if plan.gather_blocks is not None:  # rank 0 sends these blocks to another worker
            group.ranks.gather(runner.read_blocks(plan.gather_blocks), dim=4)
        if plan.scatter_blocks is not None:  # rank 0 received these blocks
            part = runner.empty_blocks(len(plan.scatter_blocks))
            group.ranks.scatter(None, part, dim=4)
            runner.write_blocks(plan.scatter_blocks, part)
        if plan.inputs is not None:
            runner.forward(plan.inputs)


if __name__ == "__main__":
    sys.exit(main())
