"""Spec checks the CRD schema cannot express (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import from_json
from kvflow.operator.api.validation import spec_problems


def problems(**overrides: Any) -> list[str]:
    data: dict[str, Any] = {"model": {"servedName": "m"}}
    data.update(overrides)
    return spec_problems(from_json(v1alpha1.InferencePoolSpec, data))


def test_a_plain_spec_has_no_problems() -> None:
    assert problems() == []
    assert (
        problems(
            colocated={"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}}
        )
        == []
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"colocated": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}},
            ["colocated.resources: requests.cpu (2) exceeds limits.cpu (1500m)"],
        ),
        (
            {"colocated": {"resources": {"limits": {"memory": "4 GB"}}}},
            [
                "colocated.resources.limits.memory: '4 GB' is not a quantity "
                "(examples: 500m, 2, 8Gi, 1G)"
            ],
        ),
        (
            {
                "engine": {"kvCacheGiB": 2},
                "colocated": {"resources": {"limits": {"memory": "2Gi"}}},
            },
            ["engine.kvCacheGiB (2) does not fit in colocated.resources.limits.memory (2Gi); "
             "raise the limit or lower the cache"],
        ),
        (
            {"colocated": {"resources": {"limits": {"memory": "768Mi"}}}},
            ["engine.kvCacheGiB (unset: 1 GiB on CPU) does not fit in colocated.resources."
             "limits.memory (768Mi); raise the limit or lower the cache"],
        ),
        (
            {"engine": {"simulate": True, "kvCacheDtype": "int8"}},
            ["engine.kvCacheDtype int8 needs a model: a simulated worker has no KV cache to "
             "quantize (set it to auto or turn simulate off)"],
        ),
        (
            {"colocated": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
            ["colocated: request GPUs with gpusPerPod, not in resources"],
        ),
        (
            {"engine": {"extraArgs": ["--port=1", "--seed", "3", "--role", "x"]}},
            ["engine.extraArgs sets --port, --role, which the operator sets from the spec"],
        ),
        (  # argparse reads a unique prefix as the whole flag
            {"engine": {"extraArgs": ["--rol", "decode", "--served-model=x", "--max-model",
                                      "999999", "--seed", "3"]}},
            ["engine.extraArgs sets --max-model, --rol, --served-model, which the operator "
             "sets from the spec"],
        ),
        (
            {"engine": {"extraArgs": ["--kv-transport=tcp", "--advertise-host", "h"]}},
            ["engine.extraArgs sets --advertise-host, --kv-transport, which the operator sets "
             "from the spec"],
        ),
        (
            {"router": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}},
            ["router.resources: requests.memory (2Gi) exceeds limits.memory (1Gi)"],
        ),
        (
            {"mode": "disaggregated", "prefill": {}},
            ["mode disaggregated needs both prefill and decode"],
        ),
        (
            {"colocated": {"gpusPerPod": 2}},
            ["colocated.gpusPerPod 2: the built-in SmolLM2-135M-Instruct (9 attention heads, "
             "3 KV heads) splits over 1 or 3 GPUs only"],
        ),
        (
            {"mode": "disaggregated", "kvTransport": "nccl", "prefill": {"gpusPerPod": 2},
             "decode": {"gpusPerPod": 1}},
            ["prefill.gpusPerPod 2: the built-in SmolLM2-135M-Instruct (9 attention heads, "
             "3 KV heads) splits over 1 or 3 GPUs only"],
        ),
    ],
)  # fmt: skip
def test_problems_say_what_to_change(overrides: dict[str, Any], expected: list[str]) -> None:
    assert problems(**overrides) == expected


def test_gpus_that_split_the_model_evenly_pass() -> None:
    assert problems(colocated={"gpusPerPod": 3}) == []  # SmolLM2's 9 and 3 heads divide by 3
    assert problems(model={"servedName": "m", "path": "/m"}, colocated={"gpusPerPod": 4}) == []
    split_pd = {"mode": "disaggregated", "kvTransport": "nccl", "prefill": {"gpusPerPod": 3},
                "decode": {"gpusPerPod": 1}}  # fmt: skip
    assert problems(**split_pd) == []


def test_the_kv_cache_may_exceed_host_memory_on_gpus() -> None:
    assert (
        problems(
            engine={"kvCacheGiB": 40},
            colocated={"gpusPerPod": 1, "resources": {"limits": {"memory": "16Gi"}}},
        )
        == []
    )
