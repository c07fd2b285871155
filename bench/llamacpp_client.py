"""`kvflow bench`, with every request asking for greedy decoding and a fixed output length
in fields both kvflow and llama.cpp's server accept.

`kvflow bench` sends ``max_tokens`` and ``ignore_eos`` and no temperature. llama-cpp-python's
server silently drops ``ignore_eos`` (its request models ignore unknown fields) and samples
at its own default temperature (0.8, top-k 40), kvflow at the model's generation config.
Both servers take ``min_tokens`` (vLLM's field; llama-cpp-python masks EOS until then) and
``temperature: 0``, so this adds ``min_tokens = max_tokens`` and ``temperature = 0`` to
every body: both servers then decode the same number of tokens greedily, from the same
request bytes. Run with `--no-ignore-eos` so the bodies are identical for both.

    python bench/llamacpp_client.py --url URL [kvflow bench options]
"""

from __future__ import annotations

import sys
from typing import Any

from kvflow.cli.bench import main
from kvflow.loadgen import payloads

_request_body = payloads.request_body


def fixed_greedy_body(
    config: payloads.EndpointConfig, request: payloads.BenchRequest
) -> dict[str, Any]:
    body = _request_body(config, request)
    body["temperature"] = 0.0
    body["min_tokens"] = body["max_tokens"]
    return body


if __name__ == "__main__":
    # encode_body looks request_body up in its module at each call.
    payloads.request_body = fixed_greedy_body
    sys.exit(main(sys.argv[1:]))
