"""Fill the sampling fields a request left out with the model's and the operator's defaults.

Pure. Precedence, per field: the request's own value, then the operator's
(`sampling.defaults` in the gateway config), then the model's (generation_config.json or
GGUF general.sampling.*, unless `sampling.generation_config: none`), then OpenAI's.
"""

from __future__ import annotations

from dataclasses import replace

from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.text.generation_config import NO_DEFAULTS, SamplingDefaults

# max_tokens is not here: its default and its cap depend on the tenant and the prompt
# (serving/token_budget.py).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(
    from_files: SamplingDefaults, operator: SamplingDefaults, *, use_files: bool
) -> SamplingDefaults:
    """The defaults a gateway applies for its model: the operator's over the files'."""
    return operator.over(from_files if use_files else NO_DEFAULTS)


def apply_sampling_defaults(s: SamplingOptions, defaults: SamplingDefaults) -> SamplingOptions:
    """``s`` with each field it left out set to ``defaults``' value, where there is one."""
    filled = {
        name: value
        for name in _SAMPLING_FIELDS
        if name in s.unset and (value := getattr(defaults, name)) is not None
    }
    return replace(s, **filled) if filled else s
