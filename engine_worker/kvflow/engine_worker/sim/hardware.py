"""Datasheet numbers of GPUs and the shapes of models, for roofline profiles. Pure data.

Bandwidths and FLOPS are the vendors' published peaks (dense bf16, no sparsity); what a
real engine reaches is a fraction of them, set per profile in ``profiles.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_bf16_flops: float  # dense, per second
    hbm_bytes_per_s: float
    hbm_bytes: float
    # The link KV moves over between prefill and decode workers (PD): NIXL over a 400 Gb/s
    # RDMA NIC reaches about 85 % of it, 42.5 GB/s.
    kv_link_bytes_per_s: float


# H100 SXM5: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, 80 GB.
H100_SXM = GpuSpec("H100-SXM", 989e12, 3.35e12, 80 * GB, 0.85 * 400e9 / 8)
# H200 SXM: the H100's compute with 4.8 TB/s HBM3e and 141 GB.
H200_SXM = GpuSpec("H200-SXM", 989e12, 4.8e12, 141 * GB, 0.85 * 400e9 / 8)

# For `kvflow plan` (capacity planning); the simulator's shipped profiles use the two above.
# Their KV links: a 200 Gb/s RDMA NIC at 85 %, the RTX 4090's 100 GbE.
# A100 SXM4: 312 TFLOPS dense bf16; 1.555 TB/s HBM2 for 40 GB, 2.039 TB/s HBM2e for 80 GB.
A100_40GB = GpuSpec("A100-40GB", 312e12, 1.555e12, 40 * GB, 0.85 * 200e9 / 8)
A100_80GB = GpuSpec("A100-80GB", 312e12, 2.039e12, 80 * GB, 0.85 * 200e9 / 8)
# L40S (PCIe, no NVLink): 362 TFLOPS dense bf16, 864 GB/s GDDR6, 48 GB.
L40S = GpuSpec("L40S", 362.05e12, 864e9, 48 * GB, 0.85 * 200e9 / 8)
# GeForce RTX 4090: 165 TFLOPS dense bf16 with fp32 accumulate, 1.008 TB/s GDDR6X, 24 GB.
RTX_4090 = GpuSpec("RTX-4090", 165.2e12, 1.008e12, 24 * GB, 0.85 * 100e9 / 8)

GPUS = {"h100": H100_SXM, "h200": H200_SXM}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-family decoder's shape: enough to count its bytes and FLOPs."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    @property
    def params_per_layer(self) -> int:
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        norms = 2 * self.hidden_size
        return q + kv + o + mlp + norms

    @property
    def num_params(self) -> int:
        """Embedding + layers + final norm + an untied LM head."""
        embed = self.vocab_size * self.hidden_size
        return 2 * embed + self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def num_matmul_params(self) -> int:
        """Weights every token multiplies by: all but the embedding (a row lookup)."""
        return self.num_params - self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """HBM the weights occupy."""
        return self.num_params * self.dtype_bytes

    @property
    def step_weight_bytes(self) -> int:
        """Weights one step reads (the embedding table only a row per token: left out)."""
        return self.num_matmul_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def matmul_flops_per_token(self) -> int:
        """A multiply and an add per weight."""
        return 2 * self.num_matmul_params

    def attention_flops_per_token(self, context_tokens: int) -> int:
        """QK^T and PV against ``context_tokens`` keys: 2 x 2 x heads x head_dim each."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context_tokens


# meta-llama/Meta-Llama-3-8B config.json: 8.03 B parameters, 128 KiB of KV per token.
LLAMA3_8B = ModelShape("Llama-3-8B", 128256, 4096, 14336, 32, 32, 8, 128)
# meta-llama/Meta-Llama-3-70B config.json: 70.6 B parameters, 320 KiB of KV per token.
LLAMA3_70B = ModelShape("Llama-3-70B", 128256, 8192, 28672, 80, 64, 8, 128)

MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
