"""The gateway's OpenAPI document (api/openapi.py) against the parsers it describes.

schemathesis trusts the document; these tests keep it honest: it is valid JSON Schema,
the bodies it calls valid parse, and it names exactly the parameters the parsers read
(a parameter added to protocol/requests.py and not here fails the test by name).
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from kvflow.router.api.openapi import build_openapi
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request
from kvflow.router.protocol.responses_api import chat_request

SCHEMA = build_openapi(served_models=["sim"], vocab_size=49152)
REQUESTS = {
    "chat": (SCHEMA["components"]["schemas"]["ChatCompletionRequest"], parse_chat_request,
             {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}),
    "completion": (SCHEMA["components"]["schemas"]["CompletionRequest"],
                   parse_completion_request, {"model": "sim", "prompt": "hi"}),
    "responses": (SCHEMA["components"]["schemas"]["ResponseRequest"], chat_request,
                  {"model": "sim", "input": "hi"}),
}  # fmt: skip
# Parameters of OpenAI's and vLLM's APIs, read or not by our parsers: each must be in the
# schema exactly when the parser reads it.
CANDIDATES = [
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "repetition_penalty", "min_tokens", "length_penalty", "best_of",
    "use_beam_search", "logit_bias", "prompt_logprobs", "truncate_prompt_tokens", "priority",
    "return_tokens_as_token_ids", "documents", "suffix", "echo", "bad_words",
    "allowed_token_ids", "spaces_between_special_tokens", "verbosity", "logprobs",
    "top_logprobs", "top_k", "min_p", "seed", "user", "metadata", "store", "service_tier",
    "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "stream_options", "max_completion_tokens", "n", "stop",
    "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
    "frequency_penalty", "presence_penalty", "temperature", "top_p", "prompt_cache_key",
    "safety_identifier", "kv_transfer_params", "request_id", "cache_salt",
    # the Responses API's
    "input", "instructions", "max_output_tokens", "text", "previous_response_id",
    "conversation", "background", "truncation", "reasoning", "prompt", "include",
    "max_tool_calls", "context_management",
]  # fmt: skip


def _reads(parse: Any, base: dict[str, Any], name: str) -> bool:
    """Does the parser read ``name``? A null value means "absent" to it, so any refusal is
    of the name itself."""
    try:
        parse({**base, name: None})
    except ApiError as exc:
        assert exc.code == "unknown_parameter" and exc.param == name, exc.message
        return False
    return True


@pytest.mark.parametrize("kind", REQUESTS)
def test_the_schema_names_exactly_the_parameters_the_parser_reads(kind: str) -> None:
    schema, parse, base = REQUESTS[kind]
    names = sorted((set(CANDIDATES) | set(schema["properties"])) - set(base))
    read = {n for n in names if _reads(parse, base, n)}
    described = set(schema["properties"]) - set(base)
    assert read - described == set(), "read by the parser, missing from api/openapi*.py"
    assert described - read == set(), "in api/openapi*.py, unknown to the parser"


@pytest.mark.parametrize("kind", REQUESTS)
def test_the_minimal_body_is_valid_and_an_unknown_field_is_not(kind: str) -> None:
    schema, parse, base = REQUESTS[kind]
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(base)
    parse(base)
    assert not validator.is_valid({**base, "no_such_parameter": 1})
    option = {"include_obfuscation": False} if kind == "responses" else {"include_usage": True}
    assert not validator.is_valid({**base, "stream_options": option})
    assert validator.is_valid({**base, "stream": True, "stream_options": option})
    parse({**base, "stream": True, "stream_options": option})
    with pytest.raises(ApiError):
        parse({**base, "stream_options": option})


def test_the_document_lists_every_route() -> None:
    assert sorted(SCHEMA["paths"]) == ["/health", "/metrics", "/ready", "/v1/batches",
                                       "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel",
                                       "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                       "/v1/files", "/v1/files/{file_id}",
                                       "/v1/files/{file_id}/content", "/v1/models",
                                       "/v1/models/{model}", "/v1/responses",
                                       "/v1/responses/{response_id}",
                                       "/v1/responses/{response_id}/input_items",
                                       "/v1/usage"]  # fmt: skip
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        responses = SCHEMA["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "503"} <= set(responses)
