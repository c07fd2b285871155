"""What an outage of a store the router shares with its replicas raises: Redis's errors,
the connection's (or a directory's disk's) OSError, and a call that timed out. Callers
wait it out, degrade or answer 503; any other exception is a bug, not an outage."""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

STORE_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError, asyncio.TimeoutError)
