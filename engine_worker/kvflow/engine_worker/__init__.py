"""The kvflow engine worker: a torch engine served over gRPC (`kvflow worker`)."""
