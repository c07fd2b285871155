"""Which `kvflow worker` flag combinations are refused, and the message that says why.

The checks run in one fixed order, so a command line with several faults always names the
same one first."""

from __future__ import annotations

import argparse

from kvflow.engine_worker.kv_transfer.peers import PeerAllowList
from kvflow.engine_worker.settings.cache_flags import memory_flags_problem
from kvflow.engine_worker.tls import TlsFiles
from kvflow.proto.roles import Role


def flags_problem(a: argparse.Namespace, tls: TlsFiles) -> str:
    """The first thing wrong with the parsed flags taken together, or ""."""
    if a.cuda_graphs and not a.device.startswith("cuda"):
        return f"--cuda-graphs needs a CUDA device (--device cuda), not {a.device!r}"
    if a.quantization == "fp8" and not a.device.startswith("cuda"):
        return (
            f"--quantization fp8 needs a CUDA GPU with FP8 tensor cores (--device cuda), not "
            f"{a.device!r}: on a CPU FP8 GEMMs run slower than bf16 ones; serve a GGUF (Q4/Q8, "
            "kept quantized) or a bf16 checkpoint instead"
        )
    problem = _tensor_parallel_problem(a) or memory_flags_problem(a)
    if problem:
        return problem
    try:
        PeerAllowList.parse(a.kv_peer_allow)
    except ValueError as exc:
        return str(exc)
    if a.task == "embed" and (a.simulate or a.tensor_parallel_size > 1 or a.role != Role.COLOCATED):
        return "--task embed runs no engine: drop --simulate, --tensor-parallel-size and --role"
    if a.max_embedding_inputs < 1 or a.max_embedding_input_tokens < 1:
        return "--max-embedding-inputs and --max-embedding-input-tokens must be at least 1"
    if a.grammar_cache_mib < 1:
        return f"--grammar-cache-mib {a.grammar_cache_mib} must be at least 1"
    if tls.problem():
        return tls.problem()
    if a.cuda_graphs and a.decode_workspace_gib:
        return (
            "--cuda-graphs replays decode steps without the decode workspace: drop "
            "--decode-workspace-gib or --cuda-graphs"
        )
    return ""


def kv_tls_problem(kv_tls: str, transport: str) -> str:
    """--kv-tls on against the KV transport the worker resolved, or ""."""
    if kv_tls == "on" and transport != "tcp":
        return f"--kv-tls on covers the tcp KV transport, not {transport} (--kv-transport tcp)"
    return ""


def _tensor_parallel_problem(a: argparse.Namespace) -> str:
    if a.tensor_parallel_size < 1:
        return f"--tensor-parallel-size {a.tensor_parallel_size}: it must be at least 1"
    if a.tensor_parallel_size > 1:
        if a.simulate:
            return "--simulate runs no model to split: drop --tensor-parallel-size"
        if a.cuda_graphs:
            return (
                "--cuda-graphs does not capture tensor-parallel steps yet: drop one of "
                "--cuda-graphs and --tensor-parallel-size"
            )
    return ""
