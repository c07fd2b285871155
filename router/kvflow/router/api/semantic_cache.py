"""The semantic cache's I/O shell (caches/semantic_service.py, docs/router.md "Semantic
cache"): its embeddings come from the gateway's own embedding pool, through the call
/v1/embeddings makes (serving/embeddings.py). The gateway's lookups are not metered to the
tenant: they are the gateway's work, as its routing is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.router.caches.semantic_service import EmbedFn
from kvflow.router.serving.embeddings import embed, embedder_info
from kvflow.router.tenants.config import ANONYMOUS

if TYPE_CHECKING:
    from kvflow.router.api.gateway import Gateway


def text_embedder(gw: Gateway, model: str, timeout_s: float) -> EmbedFn:
    """The embedding of one text by ``model``'s pool: raises ApiError when its workers
    generate (400, model_not_embedding) or none is up (503); the cache counts it a miss."""

    async def embed_text(text: str) -> Sequence[float]:
        route = gw.route(model, ANONYMOUS, None)
        pool, served_name = route.backend.pool, route.served_name
        embedder_info(pool, served_name, route.backend.name)  # 400 for a generating pool
        result = await embed(pool, served_name, [text], timeout_s=timeout_s)
        return result.vectors[0]

    return embed_text
