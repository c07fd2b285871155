"""Serving a request: prompt preparation, routing with failover, streaming text out."""
