"""KV transfer for prefill/decode disaggregation: kvflow's path against the raw ceiling.

Two peer processes on loopback (bench/kv_transfer_peer.py), a "prefill" one that sends and a
"decode" one that receives, each holding a real TorchModelRunner paged cache shaped like
Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, block size 16: 128 KiB per token in
bf16) with room for the largest transfer. Arms, interleaved (their order rotates every
repetition) between the same two processes:

  kvflow-tcp, kvflow-gloo   what EngineLoop does: transfer_blocks of scattered block ids on
                            both sides, the KvTransferAgent and its transport, which read
                            and write the caches in place (TCP: vectored I/O straight from
                            and into them; gloo: 16 MiB messages pipelined through pooled
                            staging buffers), the completion posted to the receiver's
                            thread; timed from the sender's hand-over to that completion
  raw-gloo                  one contiguous tensor of the same bytes, gloo send/recv on a
                            group that already exists
  raw-socket                sendall of the same bytes into recv_into, one open connection

The ceiling of a transport is the better of raw-gloo and raw-socket for gloo, raw-socket
for TCP (a contiguous tensor over TCP is a socket blast). Setup per transfer is the median
latency of a tiny (16 bytes) transfer through the agent once a pair exists (for gloo, the
store handshake), and the first transfer of a fresh pair (group formation) is reported
apart. The full run adds a what-if and a profile of the block I/O:

  kvflow-staged-tcp         TCP through 16 MiB host staging messages (gather, send; receive,
                            scatter), the path a CUDA cache takes, measured on the CPU cache

With --tls (quick or full) one more what-if, certificates made by openssl for the run:

  kvflow-tls-tcp            TCP with mutual TLS (the worker's --kv-tls), in place: send and
                            recv_into per run through OpenSSL instead of writev/readv

    python bench/kv_transfer.py [--quick] [--tls] [--json PATH] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kv_transfer_peer import TINY_BYTES, PeerConfig, run_peer
from kv_transfer_report import summarize, table

# Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB per token.
LLAMA3_8B_KV = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
REPLY_TIMEOUT_S = 300.0
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}  # the parent does not import torch (~3 s)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PeerHandle:
    def __init__(self, ctx: Any, cfg: PeerConfig) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_peer, args=(cfg, child), name=cfg.role, daemon=True)
        self.proc.start()
        self.role = cfg.role

    def reply(self) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise RuntimeError(f"the {self.role} peer did not answer in {REPLY_TIMEOUT_S} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"the {self.role} peer failed:\n{value}")
        return value

    def ask(self, name: str, **kwargs: Any) -> Any:
        self.conn.send((name, kwargs))
        return self.reply()

    def post(self, name: str, **kwargs: Any) -> None:
        self.conn.send((name, kwargs))


def _same(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-6) for g, w in zip(got, want, strict=True)
    )


class Bench:
    def __init__(self, pre: PeerHandle, dec: PeerHandle) -> None:
        self.pre, self.dec = pre, dec
        self._rid = 0
        self._tag = 0

    def kvflow(self, transport: str, num_blocks: int, verify: bool = False) -> dict[str, Any]:
        self._rid += 1
        rid = f"r{self._rid}"
        ticket = self.dec.ask("expect", transport=transport, num_blocks=num_blocks, rid=rid)
        self.dec.post("land", num_blocks=num_blocks, verify=verify)
        sent = self.pre.ask(
            "send", transport=transport, num_blocks=num_blocks, rid=rid, ticket=ticket
        )
        landed = self.dec.reply()
        # The keys keep their names from when the three ran one after another: "gather" is
        # now the sender's hand-over (building TransferBlocks), "send" the transfer itself
        # with its in-place reads and writes, until the last byte is in the receiver's
        # cache, "scatter" the completion reaching the receiver's engine thread.
        out = {
            "total_s": landed["scatter_end"] - sent["gather_start"],
            "gather_s": sent["gather_end"] - sent["gather_start"],
            "send_s": landed["recv_done"] - sent["gather_end"],
            "scatter_s": landed["scatter_end"] - landed["recv_done"],
        }
        if verify:
            want = self.pre.ask("checksum", num_blocks=num_blocks)
            out["verified"] = _same(landed["checksum"], want)
        return out

    def tiny(self, transport: str) -> float:
        """One-way latency (s) of a 16-byte transfer through the agent: the fixed cost."""
        self._rid += 1
        ticket = self.dec.ask("expect_tiny", transport=transport, rid=f"t{self._rid}")
        self.dec.post("land_tiny")
        started = self.pre.ask("send_tiny", transport=transport, ticket=ticket)
        return self.dec.reply() - started

    def raw(self, backend: str, num_bytes: int) -> float:
        self._tag += 1
        self.dec.post("raw_recv", backend=backend, num_bytes=num_bytes, tag=self._tag)
        assert self.dec.conn.poll(REPLY_TIMEOUT_S) and self.dec.conn.recv()[0] == "ready"
        started = self.pre.ask("raw_send", backend=backend, num_bytes=num_bytes, tag=self._tag)
        return self.dec.reply() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokens = args.tokens or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192])
    reps = args.reps or (3 if args.quick else 5)
    block_size = LLAMA3_8B_KV["block_size"]
    max_blocks = max(tokens) // block_size
    # A cache an eighth larger than the largest transfer; block ids are drawn at random
    # from all of it, so even the largest transfer reads scattered blocks.
    num_cache_blocks = max_blocks * 9 // 8
    common = dict(LLAMA3_8B_KV, num_cache_blocks=num_cache_blocks,
                  max_transfer_blocks=max_blocks, dtype=args.dtype, seed=args.seed,
                  tls_dir=args.tls_dir)  # fmt: skip
    check_memory(num_cache_blocks, max_blocks, args.dtype)
    load_start = os.getloadavg()
    log(f"load average {load_start}; spawning the prefill and decode peers")
    # The gloo receive polls its store every 20 ms and c10d logs two warnings per poll.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("spawn")
    dec = PeerHandle(ctx, PeerConfig(role="decode", **common))  # type: ignore[arg-type]
    pre = PeerHandle(ctx, PeerConfig(role="prefill", **common))  # type: ignore[arg-type]
    peer_info = dec.reply()
    bytes_per_block = peer_info.pop("bytes_per_block")
    pre.reply()
    log("peers ready")
    try:
        ends = dec.ask("endpoints")
        pre.post("connect_raw", store_port=ends["store_port"], sock_port=ends["sock_port"])
        raw_group_s = dec.ask("connect_raw")["raw_group_s"]
        pre.reply()
        bench = Bench(pre, dec)
        log("pair formed; first transfers")
        transports = ["tcp", "gloo"]
        setup: dict[str, Any] = {}
        for t in transports:  # a fresh pair: the first transfer forms the gloo group
            setup[t] = {"first_transfer_ms": bench.tiny(t) * 1e3}
        setup["raw_gloo_group_ms"] = raw_group_s * 1e3
        log("warm-up: one transfer per arm, each checked against the sender's blocks")
        verified: dict[str, bool] = {}
        arms = [f"kvflow-{t}" for t in transports] + ["raw-gloo", "raw-socket"]
        if not args.quick:
            arms.append("kvflow-staged-tcp")
        if args.tls_dir:
            arms.append("kvflow-tls-tcp")
        for arm in arms:
            sample = run_arm(bench, arm, tokens[0] // block_size, bytes_per_block, verify=True)
            if "verified" in sample:
                verified[f"{arm}/{tokens[0]}"] = sample["verified"]
        log("setup per transfer (16-byte transfers)")
        tiny_reps = 10 if args.quick else 30
        for t in transports:
            setup[t]["per_transfer_ms"] = [bench.tiny(t) * 1e3 for _ in range(tiny_reps)]
        setup["raw_gloo_tiny_ms"] = [bench.raw("gloo", TINY_BYTES) * 1e3 for _ in range(tiny_reps)]
        samples: dict[tuple[int, str], list[dict[str, float]]] = {}
        for rep in range(reps):
            log(f"repetition {rep + 1}/{reps} (load average {os.getloadavg()[0]:.2f})")
            for n_tok in tokens:
                order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
                for arm in order:
                    s = run_arm(bench, arm, n_tok // block_size, bytes_per_block)
                    samples.setdefault((n_tok, arm), []).append(s)
        profile = {}
        if not args.quick:
            log("profile of the gather and scatter at the largest size")
            profile = {
                "num_blocks": max_blocks,
                "seconds": pre.ask("profile", num_blocks=max_blocks, reps=3),
            }
        pre.ask("stop")
        dec.ask("stop")
    finally:
        for p in (pre, dec):
            p.proc.join(timeout=10)
            if p.proc.is_alive():
                p.proc.terminate()
    return {
        "benchmark": "kv_transfer",
        "command": " ".join(["python", "bench/kv_transfer.py", *sys.argv[1:]]),
        "quick": args.quick,
        "repetitions": reps,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            **peer_info,
            "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg()),
        },
        "kv": dict(common, bytes_per_token=bytes_per_block // block_size),
        "verified": verified,
        **summarize(samples, setup, bytes_per_block, block_size),
        "profile": profile,
    }


def check_memory(num_cache_blocks: int, max_blocks: int, dtype: str) -> None:
    """Refuse to start when both peers would not fit in the memory available now (the
    machine is shared: running out kills someone's process). Per side: the cache, the raw
    arms' contiguous buffer and about 0.5 GiB of runtime; the profile adds one more buffer
    of the largest transfer on the sender (kvflow's own path stages at most 12 MiB)."""
    block_bytes = 2 * LLAMA3_8B_KV["num_layers"] * LLAMA3_8B_KV["num_kv_heads"]
    block_bytes *= LLAMA3_8B_KV["head_dim"] * LLAMA3_8B_KV["block_size"]
    block_bytes *= ELEMENT_BYTES[dtype]
    per_side = (num_cache_blocks + max_blocks) * block_bytes + (1 << 29)
    need = 2 * per_side + max_blocks * block_bytes
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    if need > available:
        raise SystemExit(
            f"needs about {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available: "
            "wait for other jobs, or run --quick (4k tokens at most)"
        )
    log(f"memory: needs about {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available")


def run_arm(
    bench: Bench, arm: str, num_blocks: int, bytes_per_block: int, verify: bool = False
) -> dict[str, Any]:
    if arm.startswith("raw-"):
        return {"total_s": bench.raw(arm.removeprefix("raw-"), num_blocks * bytes_per_block)}
    return bench.kvflow(arm.removeprefix("kvflow-"), num_blocks, verify)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, 3 repetitions")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        help="transfer sizes in tokens, comma-separated, multiples of 16 (default 1k-8k)",
    )
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default 5, quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tls", action="store_true", help="add the kvflow-tls-tcp what-if")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tls_dir:
        args.tls_dir = ""
        if args.tls:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from testkit.certs import make_certs

            make_certs(Path(tls_dir))
            args.tls_dir = tls_dir
        result = run(args)
    result["wall_s"] = time.monotonic() - started
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
