"""The KV transfer path on the device's tensors, through kvflow's existing API.

In one process, a TorchModelRunner paged cache shaped like Llama-3-8B's KV:
  gather / scatter   ``read_blocks`` and ``write_blocks`` of scattered block ids (the
                     runner's block I/O), against one contiguous copy of the same bytes
  host staging       TransferBlocks.read into host memory (what gloo and TCP do with a CUDA
                     cache), against a plain device-to-host copy into pinned memory
Between two processes on the same device (gpu/kv_pair.py), every transport of the plan:
TCP and gloo stage through host memory; NCCL moves device memory but, in the NCCL versions
we know of, refuses two ranks on one GPU ("Duplicate GPU detected"). It runs last: a hang
costs only its own time, and the error is recorded as what was learned.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from dataclasses import asdict
from typing import Any

import torch

from gpu.kv_pair import PeerSpec, fill_distinct_, serve
from gpu.models import sync
from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log
from kvflow.engine_worker.runner import TorchModelRunner


def _best_s(fn: Any, device: str, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def block_io(plan: Plan, rec: Recorder) -> None:
    kv, device = plan.kv, plan.device
    max_blocks = max(plan.kv.io_tokens) // kv.block_size
    # Room for two disjoint sets of the largest transfer, plus scatter: block ids are drawn
    # at random from the whole pool, as a cache that has run a while hands them out.
    num_cache_blocks = max_blocks * 9 // 4
    runner = TorchModelRunner(
        None,  # type: ignore[arg-type]
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        num_blocks=num_cache_blocks,
        block_size=kv.block_size,
        dtype=getattr(torch, kv.dtype),
        device=device,
    )
    fill_distinct_(runner.kv_caches, plan.seed)
    rng = random.Random(plan.seed)
    rows = []
    for tokens in plan.kv.io_tokens:
        n = tokens // kv.block_size
        both = rng.sample(range(num_cache_blocks), 2 * n)
        src_ids, dst_ids = both[:n], both[n:]
        data = runner.read_blocks(src_ids)
        num_bytes = data.numel() * data.element_size()
        read_s = _best_s(lambda ids=src_ids: runner.read_blocks(ids), device)
        write_s = _best_s(lambda ids=dst_ids, d=data: runner.write_blocks(ids, d), device)
        verified = bool(torch.equal(runner.read_blocks(dst_ids), data))
        flat = data.reshape(-1)
        copy = torch.empty_like(flat)
        copy_s = _best_s(lambda c=copy, f=flat: c.copy_(f), device)
        row: dict[str, Any] = {
            "tokens": tokens,
            "num_bytes": num_bytes,
            "verified": verified,
            "read_blocks_gbps": num_bytes / read_s / 1e9,
            "write_blocks_gbps": num_bytes / write_s / 1e9,
            "contiguous_copy_gbps": num_bytes / copy_s / 1e9,
        }
        if device.startswith("cuda"):
            blocks = runner.transfer_blocks(src_ids)
            pageable = torch.empty(num_bytes, dtype=torch.uint8)
            pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
            flat_bytes = flat.view(torch.uint8)
            staged_s = _best_s(lambda b=blocks, out=pageable: b.read(0, b.num_runs, out), device)
            pinned_s = _best_s(lambda p=pinned, f=flat_bytes: p.copy_(f), device)
            row["staged_read_to_host_gbps"] = num_bytes / staged_s / 1e9
            row["pinned_d2h_copy_gbps"] = num_bytes / pinned_s / 1e9
        rows.append(row)
        rec.set("block_io", rows)
        log(
            f"kv block I/O {tokens} tokens: read {row['read_blocks_gbps']:.1f} GB/s, "
            f"write {row['write_blocks_gbps']:.1f} GB/s, "
            f"copy {row['contiguous_copy_gbps']:.1f} GB/s"
        )


class _Handle:
    def __init__(self, ctx: Any, spec: PeerSpec) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(spec, child), daemon=True)
        self.proc.start()
        self.role = spec.role

    def reply(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the {self.role} peer did not answer in {timeout_s:.0f} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"the {self.role} peer failed:\n{value}")
        return value

    def ask(self, timeout_s: float, name: str, **kwargs: Any) -> Any:
        self.conn.send((name, kwargs))
        return self.reply(timeout_s)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)


def pair_transfers(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    kv = plan.kv
    max_blocks = max(kv.transfer_tokens) // kv.block_size
    common = dict(
        device=plan.device,
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        block_size=kv.block_size,
        dtype=kv.dtype,
        num_cache_blocks=max_blocks * 9 // 8,
        timeout_s=kv.transport_timeout_s,
        seed=plan.seed,
    )
    transports = tuple(t for t in kv.transports if t != "nccl" or plan.device.startswith("cuda"))
    results: dict[str, Any] = {}
    if "nccl" in kv.transports and "nccl" not in transports:
        results["nccl"] = {"skipped": "NCCL moves CUDA tensors; this run has no GPU"}
    rec.set("pair", results)
    ctx = mp.get_context("spawn")
    wait_s = kv.transport_timeout_s + 10
    dec = _Handle(ctx, PeerSpec(role="decode", transports=transports, **common))  # type: ignore[arg-type]
    pre = _Handle(ctx, PeerSpec(role="prefill", transports=transports, **common))  # type: ignore[arg-type]
    try:
        dec.reply(120)
        pre.reply(120)
        number = 0
        for transport in transports:
            try:
                rows: list[dict[str, Any]] = []
                results[transport] = {"rows": rows}
                for tokens in kv.transfer_tokens:
                    for rep in range(2):  # the first of a pair forms its group
                        if deadline.left_s() < wait_s:
                            results[transport]["skipped"] = "stage budget spent"
                            break
                        number += 1
                        rid = f"x{number}"
                        num_blocks = tokens // kv.block_size
                        ticket = dec.ask(
                            30, "expect", transport=transport, num_blocks=num_blocks, rid=rid
                        )
                        dec.conn.send(("land", {}))
                        sent = pre.ask(
                            wait_s,
                            "send",
                            transport=transport,
                            num_blocks=num_blocks,
                            ticket=ticket,
                            rid=rid,
                        )
                        landed = dec.reply(wait_s)
                        row: dict[str, Any] = {
                            "tokens": tokens,
                            "rep": rep,
                            "num_bytes": sent["num_bytes"],
                        }
                        error = sent["error"] or landed["error"]
                        if error:
                            row["error"] = error
                        else:
                            total = landed["landed"] - sent["started"]
                            want = pre.ask(30, "checksum")
                            row.update(
                                total_s=total,
                                gbps=sent["num_bytes"] / total / 1e9,
                                verified=want == landed["checksum"],
                            )
                        rows.append(row)
                        rec.set("pair", results)
                        log(
                            f"kv pair {transport} {tokens} tokens rep {rep}: "
                            + (f"error {error[:200]}" if error else f"{row['gbps']:.2f} GB/s")
                        )
                        if error:
                            break
                    if rows and "error" in rows[-1]:
                        break
            except (TimeoutError, RuntimeError) as exc:
                # A peer that hung or died: record it under this transport; the peers are
                # in no state for another (NCCL runs last for this reason).
                results[transport]["error"] = f"{type(exc).__name__}: {exc}"[:3000]
                rec.set("pair", results)
                log(f"kv pair {transport}: {type(exc).__name__}: {str(exc)[:300]}")
                return
        for h in (dec, pre):
            h.ask(10, "stop")
    finally:
        for h in (dec, pre):
            h.kill()
    rec.set("pair", results)


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    rec.set("kv_shape", asdict(plan.kv))
    with rec.part("block_io"):
        block_io(plan, rec)
    with rec.part("pair"):
        pair_transfers(plan, rec, deadline)
