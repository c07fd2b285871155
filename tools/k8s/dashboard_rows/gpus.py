"""The GPU row: NVIDIA DCGM exporter series (utilisation, memory, power, XID errors) of the
selected pools' worker GPUs, beside the worker's own device-memory split."""

from __future__ import annotations

from dashboard_query import GPU, SEL, Panel, on_workers

TITLE = "GPUs (NVIDIA DCGM exporter), beside the latencies above"

PANELS: list[Panel] = [
    Panel(
        "GPU utilisation",
        "percent",
        ((on_workers("DCGM_FI_DEV_GPU_UTIL"), GPU),),
        "Time the GPU ran a kernel (DCGM_FI_DEV_GPU_UTIL), per worker GPU. Low utilisation "
        "with high TPOT points at the host (scheduling, sampling), not the device.",
    ),
    Panel(
        "GPU memory",
        "decmbytes",
        (
            (on_workers("DCGM_FI_DEV_FB_USED"), GPU + " used"),
            (on_workers("DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE"), GPU + " total"),
        ),
        "Framebuffer used and total (MiB, DCGM), every process on the GPU; "
        "KvflowGPUMemoryFull alerts near full.",
    ),
    Panel(
        "Worker device memory by part",
        "bytes",
        (
            (
                "sum by (pod, part) (kvflow_worker_device_memory_bytes{" + SEL + "})",
                "{{pod}} {{part}}",
            ),
        ),
        "The worker's own split (its /metrics): weights, KV cache, CUDA graphs, and the "
        "rest of torch's allocator.",
        stack=True,
    ),
    Panel(
        "GPU power",
        "watt",
        ((on_workers("DCGM_FI_DEV_POWER_USAGE"), GPU),),
        "Board power draw (DCGM_FI_DEV_POWER_USAGE).",
    ),
    Panel(
        "GPU XID errors",
        "short",
        ((on_workers("DCGM_FI_DEV_XID_ERRORS"), GPU),),
        "The last XID the driver reported for the GPU (0: none); KvflowGPUXidError alerts on any.",
    ),
]
