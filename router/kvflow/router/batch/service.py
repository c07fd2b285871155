"""The Batch API wired into an app: its store (Redis when the gateway has it, else
--batch-dir, else off), its routes, and its runner, started and stopped with the app."""

from __future__ import annotations

from fastapi import FastAPI

from kvflow.router.api.gateway import Gateway
from kvflow.router.batch.routes import BatchApi, add_batch_routes
from kvflow.router.batch.runner import BatchRunner
from kvflow.router.batch.store import BatchStore, DirBatchStore, RedisBatchStore


def batch_store(gateway: Gateway) -> BatchStore | None:
    config = gateway.settings.batch
    if gateway.redis is not None:
        return RedisBatchStore(gateway.redis, gateway.settings.quota_scope)
    if config.batch_dir is not None:
        return DirBatchStore(config.batch_dir)
    return None


def install_batches(app: FastAPI, gateway: Gateway) -> BatchRunner | None:
    """The routes on ``app``; the runner to start with it (None: the API is off)."""
    store = batch_store(gateway)
    config = gateway.settings.batch
    add_batch_routes(app, gateway, BatchApi(gateway, store, config) if store else None)
    return BatchRunner(app, gateway, store, config) if store is not None else None
