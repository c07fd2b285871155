"""Memory of one worker: what its weights take, what the KV cache gets, whether it fits."""
