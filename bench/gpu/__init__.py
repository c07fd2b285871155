"""The stages of bench/gpu_check.py: one module per thing measured, each run in its own
process by ``gpu.stage`` so that a crash, an out-of-memory or a hang in one stage costs
that stage alone."""
