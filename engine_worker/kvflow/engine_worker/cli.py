"""`kvflow worker`: serve a model over gRPC."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from kvflow.engine_worker import tracing
from kvflow.engine_worker.settings import parse_args


def main(argv: Sequence[str]) -> int:
    settings = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    tracing.configure(settings.tracing)
    if settings.task == "embed":
        from kvflow.engine_worker.embed.app import serve_embed as serve
    else:
        from kvflow.engine_worker.app import serve

    try:
        asyncio.run(serve(settings))
    except OSError as exc:  # a port taken names itself (listen.PortTakenError)
        print(f"kvflow worker: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # ModelLoadError and bad settings say what to change
        print(f"kvflow worker: {exc}", file=sys.stderr)
        return 1
    return 0
