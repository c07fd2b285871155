"""The router's request-limit and preparation flags (docs/router.md, "Request limits")."""

from __future__ import annotations

import argparse
from dataclasses import fields as dataclass_fields

from kvflow.proto.cli_args import positive_int, seconds
from kvflow.router.api.http_limits import DEFAULT_BODY_TIMEOUT_S
from kvflow.router.protocol.limits import RequestLimits, flag_of
from kvflow.router.serving.prepare import PREPARE_FLAGS, PrepareConfig
from kvflow.router.settings import ConfigError

# -- Request limits and preparation --------------------------------------------------------

_LIMIT_HELP = {
    "max_prompts_per_request": "prompts in one /v1/completions request",
    "max_n": "choices per prompt (n)",
    "max_choices_per_request": "prompts x n of one request",
    "max_stop_strings": "stop strings of one request",
    "max_stop_string_chars": "characters in one stop string",
    "max_stop_token_ids": "entries of stop_token_ids",
    "max_logit_bias_entries": "entries of logit_bias",
    "max_schema_bytes": "bytes of one JSON schema, regex or grammar (response_format, "
    "structured_outputs, each tool's parameters)",
    "max_schema_depth": "nesting levels of one JSON schema's text",
    "max_messages": "messages of one chat request",
}


def request_limit_flags(
    p: argparse.ArgumentParser,
    limits: RequestLimits,
    prepare: PrepareConfig,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> None:
    g = p.add_argument_group(
        "request limits",
        "what one request may ask for; past a limit it is a 400 naming it "
        '(docs/router.md, "Request limits")',
    )
    for f in dataclass_fields(limits):
        g.add_argument(flag_of(f.name), type=positive_int, default=getattr(limits, f.name),
                       metavar="N",
                       help=f"most {_LIMIT_HELP[f.name]} (default: %(default)s)")  # fmt: skip
    g.add_argument(
        "--max-body-bytes",
        type=positive_int,
        metavar="BYTES",
        help="largest request body; larger is a 413 (default: the config's "
        "limits.max_body_bytes, else 8 MiB)",
    )
    g.add_argument(
        "--body-timeout-s",
        type=seconds(allow_zero=False),
        default=body_timeout_s,
        metavar="S",
        help="a request body must arrive within this of its headers; later is a 408 and the "
        "connection is closed (default: %(default)s)",
    )
    g.add_argument(
        PREPARE_FLAGS["threads"],
        type=positive_int,
        default=prepare.threads,
        metavar="N",
        help="threads that render chat templates, tokenize and compile grammars, off the "
        "event loop (default: %(default)s)",
    )
    g.add_argument(
        PREPARE_FLAGS["max_waiting"],
        type=int,
        default=prepare.max_waiting,
        metavar="N",
        help="requests waiting for a prepare thread; past that 503 (default: %(default)s)",
    )
    g.add_argument(
        PREPARE_FLAGS["timeout_s"],
        type=seconds(allow_zero=False),
        default=prepare.timeout_s,
        metavar="S",
        help="a request's preparation past this is a 400 (503 if it was still waiting for "
        "a thread) (default: %(default)s)",
    )


def parse_request_limits(args: argparse.Namespace) -> tuple[RequestLimits, PrepareConfig]:
    try:
        limits = RequestLimits(
            **{f.name: getattr(args, f.name) for f in dataclass_fields(RequestLimits)}
        )
        prepare = PrepareConfig(args.prepare_threads, args.prepare_max_waiting,
                                args.prepare_timeout_s)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return limits, prepare
