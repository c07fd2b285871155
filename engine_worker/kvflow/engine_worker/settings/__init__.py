"""`kvflow worker` settings: one typed record (record.py), parsed from the command line
(parse.py) by flag group: model, serving, scheduler, cache and KV transport."""

from kvflow.engine_worker.settings.cache_flags import KV_CACHE_DTYPES
from kvflow.engine_worker.settings.model_flags import DTYPES, QUANTIZATIONS
from kvflow.engine_worker.settings.parse import parse_args
from kvflow.engine_worker.settings.record import (
    DEFAULT_CPU_KV_CACHE_GIB,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    WorkerSettings,
)
from kvflow.engine_worker.settings.scheduler_flags import DEFAULT_MAX_WAITING_REQUESTS

__all__ = [
    "DEFAULT_CPU_KV_CACHE_GIB",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_MAX_WAITING_REQUESTS",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "QUANTIZATIONS",
    "WorkerSettings",
    "parse_args",
]
