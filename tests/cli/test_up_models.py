"""`kvflow up` with several models, the pure part: pairing flags, pool names, the config."""

from __future__ import annotations

import pytest

from kvflow.cli.up_models import UpModel, UpModelsError, pair_models, router_config
from kvflow.router.settings import parse_config


def test_one_model_is_the_old_default() -> None:
    assert pair_models(None, None) == [UpModel("smollm2", None, "smollm2")]
    assert pair_models(["m.gguf"], None) == [UpModel("smollm2", "m.gguf", "smollm2")]
    assert pair_models(None, ["x"]) == [UpModel("x", None, "x")]


def test_models_pair_with_names_by_position_and_get_dns_label_pools() -> None:
    paired = pair_models(["a.gguf", "b"], ["Qwen/Qwen2.5", "qwen-qwen2-5"])
    assert paired == [UpModel("Qwen/Qwen2.5", "a.gguf", "qwen-qwen2-5"),
                      UpModel("qwen-qwen2-5", "b", "qwen-qwen2-5-2")]  # fmt: skip
    assert [m.model for m in pair_models(None, ["a", "b"])] == [None, None]


@pytest.mark.parametrize(
    ("models", "names", "says"),
    [
        (["a", "b"], None, "2 --model flags need as many --served-model-name"),
        (["a", "b"], ["x", "y", "z"], "2 --model flags need as many"),
        (["a"], ["x", "y"], "2 --served-model-name flags need no --model"),
        (None, ["x", "x"], "each --served-model-name must differ"),
    ],
)
def test_flags_that_do_not_pair_are_refused(
    models: list[str] | None, names: list[str] | None, says: str
) -> None:
    with pytest.raises(UpModelsError, match=says):
        pair_models(models, names)


def test_the_generated_config_is_one_the_router_accepts() -> None:
    paired = pair_models(None, ["a", "b"])
    config = parse_config(router_config(paired, [["127.0.0.1:1"], ["127.0.0.1:2", "h:3"]]))
    assert [(p.name, p.served_model_name, p.workers) for p in config.pools] == [
        ("a", "a", ("127.0.0.1:1",)), ("b", "b", ("127.0.0.1:2", "h:3"))]  # fmt: skip
    assert config.models.public_names({"a": "a", "b": "b"}) == ["a", "b"]
