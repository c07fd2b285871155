"""`kvflow worker`'s model flags: which model, for which task, and how its weights run."""

from __future__ import annotations

import argparse

from kvflow.engine_worker.settings.record import WorkerSettings
from kvflow.proto.cli_args import positive_int

# auto: the checkpoint's dtype where the device computes it natively, else float32
# (auto_dtype.py). No float16: the loader runs none (some checkpoints' activations overflow
# it), so the command line refuses it up front rather than after parsing the weights.
DTYPES = ("auto", "float32", "bfloat16")
# auto: a GGUF's quantized matrices stay quantized (4-bit planes multiplied by torch's int4
# kernels: model/quant/); none: widened to --dtype at load, as before; fp8: a float
# checkpoint's projections quantized to e4m3 at load (GPUs with FP8 tensor cores).
QUANTIZATIONS = ("auto", "none", "fp8")


def add_model_flags(p: argparse.ArgumentParser, d: WorkerSettings) -> None:
    p.add_argument(
        "--model",
        help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct); with "
        "--task embed an embedding model (default and only: wordllama-l2-supercat)",
    )
    p.add_argument(
        "--task",
        choices=("generate", "embed"),
        default=d.task,
        help="generate text (the engine), or embed: serve /v1/embeddings (docs/engine.md)",
    )
    p.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=d.max_embedding_inputs,
        help="--task embed: inputs per request; more is refused (400)",
    )
    p.add_argument(
        "--max-embedding-input-tokens",
        type=int,
        default=d.max_embedding_input_tokens,
        help="--task embed: tokens per input; a longer one is refused (400)",
    )
    p.add_argument("--served-model-name", help="name clients use (default: the model's name)")
    p.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=d.dtype,
        help="auto: a bfloat16 checkpoint runs in bfloat16 where the device computes it "
        "natively (GPUs from A100 on, CPUs with AVX512-BF16 or AMX); a GGUF, a float32 "
        "checkpoint or another device runs in float32",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=d.quantization,
        help="auto: a GGUF's quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
        "Q6_K) stay quantized and are multiplied by torch's int4 kernels, other types are "
        "refused by name; none: every weight widened to --dtype at load; fp8: a float "
        "checkpoint's attention and MLP weights quantized to FP8 (e4m3, a scale per row) as "
        "they load, for GPUs with FP8 tensor cores (L4, H100, H200)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many devices (cuda:0..N-1 from --device on, or CPU "
        "processes sharing the cores): heads, MLP and vocabulary divide among the ranks, "
        "which this worker spawns and leads; one worker to the router",
    )
    p.add_argument(
        "--max-model-len", type=positive_int, help="context length (default: the model's)"
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode steps from CUDA graphs, one per power-of-two batch and context "
        "bucket, captured on first use (CUDA devices only; not yet measured on a GPU: "
        "docs/engine.md)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of unseeded sampling")
