"""How one replica is deployed: which GPU, how many per replica, what precision, what engine.

The engine's efficiencies (fractions of the datasheet a real engine reaches, memory it
leaves for activations) are the simulator's ``Efficiency``, so a plan and a simulated
worker of the same GPU and model agree on step times and KV capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.gpus import GpuOffer
from kvflow.engine_worker.sim.profiles import Efficiency
from kvflow.proto.cli_args import is_non_negative


@dataclass(frozen=True, slots=True)
class Deployment:
    gpu: GpuOffer
    tp: int  # GPUs per replica (tensor parallelism)
    weight_dtype: str  # a label for the report: "bf16", "int4", "gguf"...
    weight_bytes_per_param: float
    kv_dtype: str
    kv_bytes_per_value: float
    eff: Efficiency = field(default_factory=Efficiency)
    # vLLM's defaults: at most 256 running sequences, 8,192 tokens per step (so a prompt
    # longer than that prefills in chunks).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    redundancy_replicas: int = 0  # spares on top of what the load needs (N+1: 1)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise PlanError(f"--tp must be >= 1, got {self.tp}")
        if min(self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise PlanError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
        if self.redundancy_replicas < 0:
            raise PlanError(f"--redundancy must be >= 0, got {self.redundancy_replicas}")
        eff = self.eff
        for name, value in (
            ("--gpu-memory-utilization", eff.memory_utilization),
            ("--bandwidth-efficiency", eff.memory),
            ("--mfu", eff.compute),
            ("--tp-efficiency", eff.tensor_parallel),
        ):
            if not 0 < value <= 1:
                raise PlanError(f"{name} must be in (0, 1], got {value}")
        if not (
            is_non_negative(eff.activation_bytes_per_gpu) and is_non_negative(eff.step_overhead_s)
        ):
            raise PlanError("--overhead-gb and --step-overhead-ms must be >= 0")

    @property
    def gpu_name(self) -> str:
        return self.gpu.spec.name

    @property
    def tp_scale(self) -> float:
        """Effective GPUs of a replica: all-reduces between layers cost the rest."""
        return self.tp * (self.eff.tensor_parallel if self.tp > 1 else 1.0)
