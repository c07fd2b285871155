"""Rank 0's side of tensor parallelism: the ranks it spawns, and the runner that leads them.

``kvflow worker --tensor-parallel-size N`` is one worker to the router: one gRPC server, one
scheduler, one block manager, on rank 0. It spawns ranks 1..N-1 as processes of its own
(``follower.py``), on ``cuda:r`` or the CPU, each loading its slice of the model and its
share of the KV cache (its KV heads; the same block ids on every rank). Each step,
``TensorParallelRunner`` sends the step's plan, then runs its own slice of the forward pass
with the others (their sums and the logits' gather happen inside it) and samples.

A rank that exits is a worker that cannot compute: ``problem()`` says which one, and the
worker's health (``/health``, gRPC Health) fails with it, so the kubelet restarts the pod
and routers send no more requests. The step in flight fails (its collective finds the peer
gone) and its requests are aborted, which a router retries elsewhere when nothing was
streamed yet.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

import torch

from kvflow.engine_worker.core.engine import SampledToken
from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.engine_worker.runner import TorchModelRunner
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.engine_worker.step_inputs import step_inputs
from kvflow.engine_worker.tp.group import RankGroup, join, open_store
from kvflow.engine_worker.tp.plan import StepPlan

log = logging.getLogger(__name__)

SETTINGS_ENV, RANK_ENV, PORT_ENV = "KVFLOW_TP_SETTINGS", "KVFLOW_TP_RANK", "KVFLOW_TP_PORT"
# Ranks load in parallel with rank 0; a large model from a slow disk takes minutes.
LOAD_TIMEOUT_S = 1800.0
_STOP_TIMEOUT_S = 10.0


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the GPU ``rank`` places after ``device``'s, or the CPU."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def threads_per_rank(size: int) -> int:
    """On the CPU the ranks share the machine's cores; each takes an even share."""
    return max(1, (os.cpu_count() or 1) // size)


def settings_to_json(settings: WorkerSettings) -> str:
    return json.dumps(dataclasses.asdict(settings))


class RankLostError(RuntimeError):
    """A tensor-parallel rank has exited: no step can run."""


class Followers:
    """Ranks 1..size-1 as child processes: started, watched, stopped."""

    def __init__(self, settings: WorkerSettings, port: int) -> None:
        self.size = settings.tensor_parallel_size
        env = {**os.environ, SETTINGS_ENV: settings_to_json(settings), PORT_ENV: str(port)}
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        for rank in range(1, self.size):
            self.processes[rank] = subprocess.Popen(
                [sys.executable, "-m", "kvflow.engine_worker.tp.follower"],
                env={**env, RANK_ENV: str(rank)},
            )
        self._stopping = False
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        """Which rank has exited, or None while every rank runs."""
        with self._lock:
            if self._stopping:
                return None
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None:
                    return (
                        f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                        f"{code}; the worker cannot compute without it"
                    )
        return None

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        for process in self.processes.values():
            try:
                process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@dataclasses.dataclass
class LeaderGroup:
    group: RankGroup
    followers: Followers

    def close(self) -> None:
        """Tell every rank to stop (best effort: a rank may be gone), then reap them."""
        try:
            self.group.plans.send(StepPlan())
        except RuntimeError as err:
            log.info("tensor-parallel ranks not told to stop: %s", err)
        self.followers.stop()


def start_ranks(settings: WorkerSettings) -> LeaderGroup:
    """Spawn ranks 1..N-1 and form the group with them (rank 0 is this process)."""
    store = open_store()
    followers = Followers(settings, store.port)
    log.info(
        "tensor parallel over %d ranks: spawned %s",
        settings.tensor_parallel_size,
        ", ".join(f"rank {r} (pid {p.pid})" for r, p in followers.processes.items()),
    )
    try:
        group = join(
            store, 0, settings.tensor_parallel_size, cuda=settings.device.startswith("cuda")
        )
    except BaseException:
        for process in followers.processes.values():
            process.kill()
        raise
    return LeaderGroup(group, followers)


class TensorParallelRunner:
    """The model runner of rank 0: sends each step's plan, runs its slice, samples.

    KV transfers (PD) move whole blocks, every KV head: rank 0 gathers the ranks' shares of
    the blocks it sends and scatters the blocks it receives (``read_blocks`` and
    ``write_blocks``, buffered). So the wire carries what an unsplit worker's does, and a
    prefill worker over 2 ranks hands blocks to a decode worker over 1, 2 or 4 alike.
    """

    def __init__(self, local: TorchModelRunner, leader: LeaderGroup, kv_layout: str) -> None:
        """``kv_layout``: the layout of a whole block (every KV head), as an unsplit worker
        of this model has it."""
        self.local = local
        self.leader = leader
        self._released: list[str] = []
        self.kv_layout = kv_layout

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        if (problem := self.leader.followers.problem()) is not None:
            raise RankLostError(problem)  # the step fails at once: its requests are aborted
        inputs = step_inputs(output)
        released, self._released = self._released, []
        self.leader.group.plans.send(StepPlan(inputs, released))
        logits = self.local.forward(inputs)
        if logits is None:
            return {}
        return self.local.sample(logits, [s.request for s in output.scheduled if s.samples])

    def release(self, request_id: str) -> None:
        self.local.release(request_id)
        self._released.append(request_id)  # for the other ranks' decode workspaces

    def close(self) -> None:
        self.leader.close()

    # -- whole blocks (PD), on the engine thread like every plan ------------------------------
    # A buffer is [layers, blocks, block_size, 2, KV heads, head_dim]: rank r's heads are
    # slice r of dim 4.

    def empty_blocks(self, num_blocks: int) -> torch.Tensor:
        local = self.local.empty_blocks(num_blocks)
        shape = list(local.shape)
        shape[_HEADS_DIM] *= self.leader.group.size
        return local.new_empty(shape)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        group = self.leader.group
        group.plans.send(StepPlan(gather_blocks=list(block_ids)))
        whole = group.ranks.gather(self.local.read_blocks(block_ids), dim=_HEADS_DIM)
        assert whole is not None
        return whole

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        group = self.leader.group
        group.plans.send(StepPlan(scatter_blocks=list(block_ids)))
        part = self.local.empty_blocks(len(block_ids))
        group.ranks.scatter(data, part, dim=_HEADS_DIM)
        self.local.write_blocks(block_ids, part)


_HEADS_DIM = 4  # of a [layers, blocks, block_size, 2, KV heads, head_dim] block buffer
