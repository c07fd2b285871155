"""The engine's pure core: requests, block pool, prefix cache, scheduler. No torch, no I/O."""
