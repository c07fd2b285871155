"""Moving KV blocks between workers for prefill/decode disaggregation (docs/disaggregation.md).

``base`` holds the contract (a transport's worker side, its errors), ``tcp`` and
``torch_dist`` the transports, ``agent`` the part the engine loop talks to: it runs the
blocking transfers on their own threads and reports completions back as callbacks.
"""
