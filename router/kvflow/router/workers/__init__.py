"""The router's side of the workers: gRPC clients, health and load probes, KV event
subscriptions feeding the block index, and discovery. The I/O shell around routing/."""
