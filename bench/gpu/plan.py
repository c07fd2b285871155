"""What each stage of the GPU check runs, per size: pure data, no torch.

``full`` is the H200 run (8 minutes at most with setup; budgets below), ``small`` the CUDA
path at SmolLM2's shape for the ``gpu`` tests (about 2 minutes), ``tiny`` the CPU mode that
CI runs end to end (under a minute on two busy cores). The model shapes the stages name
are shapes.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParityPlan:
    cases: tuple[tuple[str, str], ...]  # (shape, dtype)
    prompt_lens: tuple[int, ...]  # around block boundaries (16) and one long prompt
    new_tokens: int


@dataclass(frozen=True)
class RooflinePlan:
    shape: str
    prompt_len: int
    new_tokens: int
    graph_steps: int  # decode forwards replayed in the CUDA-graph what-if
    hf_new_tokens: int  # transformers' generate at batch 1, for reference (0: skip)
    # Further shapes whose batch-1 decode (eager and --cuda-graphs) is put against their
    # own roofline: the 70B layer slice.
    extra_shapes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrefillPlan:
    shapes: tuple[str, ...]
    prompt_len: int  # one prompt, prefilled in chunks of max_num_batched_tokens
    max_num_batched_tokens: int


@dataclass(frozen=True)
class QuantPlan:
    shape: str
    prompt_len: int
    new_tokens: int  # batch-1 decode, and the greedy tokens compared with bf16's
    batch: int  # a throughput point: this many requests at once
    batch_new_tokens: int


@dataclass(frozen=True)
class ProfilePlan:
    shape: str
    max_prompt_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    quick: bool


@dataclass(frozen=True)
class ThroughputPlan:
    shape: str
    batch_sizes: tuple[int, ...]  # in the order run: the published points first
    prompt_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    kv_cache_gib: float
    max_num_batched_tokens: int


@dataclass(frozen=True)
class KvPlan:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    io_tokens: tuple[int, ...]  # read_blocks / write_blocks sizes, in one process
    transfer_tokens: tuple[int, ...]  # between two processes
    transports: tuple[str, ...]  # nccl last: on one GPU it may hang until killed
    transport_timeout_s: float


@dataclass(frozen=True)
class Plan:
    size: str
    device: str
    parity: ParityPlan
    roofline: RooflinePlan
    throughput: ThroughputPlan
    kv: KvPlan
    prefill: PrefillPlan
    quant: QuantPlan
    profile: ProfilePlan
    # Seconds per stage, worst case: the stage is killed at its budget and keeps what it
    # wrote so far. The full plan's sum (445 s) is capped by the run's total (gpu_check.py,
    # TOTAL_BUDGET_S: 430 s) which, with setup (~20 s), stays under the 8 minutes the
    # device session allots.
    budgets_s: dict[str, float] = field(default_factory=dict)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> Plan:
        def tup(d: dict[str, Any]) -> dict[str, Any]:
            return {
                k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                if isinstance(v, list)
                else v
                for k, v in d.items()
            }

        return Plan(
            size=raw["size"],
            device=raw["device"],
            parity=ParityPlan(**tup(raw["parity"])),
            roofline=RooflinePlan(**tup(raw["roofline"])),
            throughput=ThroughputPlan(**tup(raw["throughput"])),
            kv=KvPlan(**tup(raw["kv"])),
            prefill=PrefillPlan(**tup(raw["prefill"])),
            quant=QuantPlan(**raw["quant"]),
            profile=ProfilePlan(**raw["profile"]),
            budgets_s=dict(raw["budgets_s"]),
            seed=raw["seed"],
        )


LLAMA3_8B_KV = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
# In the order run: what issue 34 asks first; the KV transfer last (a hang costs only itself).
STAGES = (
    "env",
    "gpu_tests",
    "parity",
    "roofline",
    "prefill",
    "throughput",
    "quant",
    "profile",
    "kv_transfer",
)


def kv_plan(layout: dict[str, int], dtype: str, tokens: tuple[int, ...]) -> KvPlan:
    """The KV stage of every size: ``tokens`` both read and written in one process and sent
    between two, over every transport (nccl last: on one GPU it may hang until killed)."""
    return KvPlan(
        **layout,
        dtype=dtype,
        io_tokens=tokens,
        transfer_tokens=tokens,
        transports=("tcp", "gloo", "nccl"),
        transport_timeout_s=20.0,
    )


def make_plan(size: str, device: str) -> Plan:
    if size == "full":
        return Plan(
            size,
            device,
            ParityPlan(
                # The 8B shape first: issue 34's parity case, whatever the budget leaves.
                (("llama3-8b", "bfloat16"), ("smollm2", "float32"), ("smollm2", "bfloat16")),
                (5, 16, 17, 100, 300),
                32,
            ),
            RooflinePlan(
                "llama3-8b",
                prompt_len=512,
                new_tokens=192,
                graph_steps=100,
                hf_new_tokens=48,
                extra_shapes=("llama3-70b-slice",),
            ),
            # 8-256 concurrent requests of Llama-3-8B: 256 x 384 tokens of KV is 12 GiB.
            ThroughputPlan(
                "llama3-8b",
                (8, 64, 256),
                (64, 192),
                (64, 192),
                kv_cache_gib=24.0,
                max_num_batched_tokens=8192,
            ),
            kv_plan(LLAMA3_8B_KV, "bfloat16", (1024, 4096)),
            # An 8K prompt (8176 + 1 generated = 8192, the shapes' context) in one chunk.
            PrefillPlan(("llama3-8b", "llama3-70b-slice"), 8176, 8192),
            QuantPlan("llama3-8b", prompt_len=512, new_tokens=64, batch=64, batch_new_tokens=64),
            ProfilePlan(
                "llama3-8b",
                max_prompt_tokens=2048,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                num_kv_blocks=8192,
                quick=False,
            ),
            budgets_s={
                "env": 20,
                "gpu_tests": 50,
                "parity": 60,
                "roofline": 50,
                "prefill": 30,
                "throughput": 120,
                "quant": 45,
                "profile": 45,
                "kv_transfer": 25,
            },
        )
    if size == "small":
        return Plan(
            size,
            device,
            ParityPlan((("smollm2", "float32"), ("smollm2", "bfloat16")), (5, 17, 100), 24),
            RooflinePlan(
                "smollm2",
                prompt_len=256,
                new_tokens=64,
                graph_steps=30,
                hf_new_tokens=16,
                extra_shapes=("tiny-gqa8",),
            ),
            ThroughputPlan(
                "smollm2",
                (8, 64),
                (32, 96),
                (32, 96),
                kv_cache_gib=2.0,
                max_num_batched_tokens=4096,
            ),
            kv_plan(LLAMA3_8B_KV, "bfloat16", (1024,)),
            PrefillPlan(("smollm2", "tiny-gqa8"), 2048, 2048),
            QuantPlan("smollm2", prompt_len=128, new_tokens=32, batch=16, batch_new_tokens=32),
            ProfilePlan(
                "smollm2",
                max_prompt_tokens=512,
                max_num_seqs=32,
                max_num_batched_tokens=1024,
                num_kv_blocks=2048,
                quick=True,
            ),
            budgets_s={
                "env": 30,
                "gpu_tests": 90,
                "parity": 60,
                "roofline": 45,
                "prefill": 30,
                "throughput": 90,
                "quant": 40,
                "profile": 40,
                "kv_transfer": 60,
            },
        )
    assert size == "tiny", size
    # The KV of the CPU mode: 4 layers x 2 heads x 32 dims, 16-token blocks (32 KiB each).
    tiny_kv = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 16}
    return Plan(
        size,
        device,
        ParityPlan((("tiny", "float32"), ("tiny", "bfloat16")), (5, 17, 40), 8),
        RooflinePlan(
            "tiny",
            prompt_len=32,
            new_tokens=16,
            graph_steps=0,
            hf_new_tokens=128,
            extra_shapes=("tiny-gqa8",),
        ),
        ThroughputPlan(
            "tiny", (2, 4), (8, 24), (4, 12), kv_cache_gib=0.01, max_num_batched_tokens=256
        ),
        kv_plan(tiny_kv, "float32", (64, 256)),
        PrefillPlan(("tiny", "tiny-gqa8"), 256, 128),
        QuantPlan("tiny", prompt_len=24, new_tokens=8, batch=4, batch_new_tokens=6),
        ProfilePlan(
            "tiny",
            max_prompt_tokens=128,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            num_kv_blocks=256,
            quick=True,
        ),
        # Generous: the CPU mode runs its stages in one process (gpu_check.py, --isolate),
        # stopped only by their own checks of these, on CI machines that may be busy.
        budgets_s=dict.fromkeys(STAGES, 120.0),
    )
