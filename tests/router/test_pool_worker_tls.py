"""Each `pools:` entry dials its workers its own way (models/pools.py `worker_tls`): its own
CA, certificate, key and server name; `{}` for plaintext; left out, the --worker-tls-*
flags' setting. Bad entries are refused at start with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvflow.router.cli import parse_args
from kvflow.router.settings import ConfigError, parse_config
from kvflow.router.workers.tls import WorkerTls


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    """Files where the settings point; their content is read only when dialling."""
    paths = {}
    for name in ("ca", "cert", "key"):
        (tmp_path / f"{name}.pem").write_text("-----BEGIN X-----\n")
        paths[name] = str(tmp_path / f"{name}.pem")
    return paths


def pools(pem: dict[str, str], **tls: Any) -> list[dict[str, Any]]:
    secure = {"ca_file": pem["ca"], "cert_file": pem["cert"], "key_file": pem["key"],
              "server_name": "a-workers.ns.svc", **tls}  # fmt: skip
    return [
        {"name": "a", "workers": ["127.0.0.1:1"], "worker_tls": secure},
        {"name": "b", "workers": ["127.0.0.1:2"], "worker_tls": {}},
        {"name": "c", "workers": ["127.0.0.1:3"]},
    ]


def test_each_pool_has_its_own_tls_plaintext_or_the_flags(pem: dict[str, str]) -> None:
    a, b, c = parse_config({"pools": pools(pem)}).pools
    flags = WorkerTls(pem["ca"], None, None, "flags.svc")
    assert a.tls(flags) == WorkerTls(pem["ca"], pem["cert"], pem["key"], "a-workers.ns.svc")
    assert b.tls(flags) == WorkerTls() and not b.tls(flags).is_on  # plaintext, whatever the flags
    assert c.tls(flags) is flags  # left out: the command line's


def test_the_flags_are_the_default_of_pools_without_their_own(
    pem: dict[str, str], tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"pools": pools(pem)}))
    settings = parse_args(["--config", str(config), "--worker-tls-ca-file", pem["ca"]], env={})
    assert settings is not None
    a, b, c = settings.config.pools
    assert c.tls(settings.worker_tls) == WorkerTls(pem["ca"])
    assert not b.tls(settings.worker_tls).is_on
    assert a.tls(settings.worker_tls).cert_file == pem["cert"]


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert_file": None}, "pools[0].worker_tls.cert_file and pools[0].worker_tls.key_file "
                              "go together"),
        ({"ca_file": None}, "pools[0].worker_tls.ca_file is needed"),
        ({"key_file": "/nonexistent/key.pem"}, "pools[0].worker_tls.key_file /nonexistent/"
                                               "key.pem: no such file"),
        ({"server_name": ""}, "pools[0].worker_tls.server_name must be a non-empty string"),
        ({"ca": "x"}, "pools[0].worker_tls has unknown fields ['ca']"),
    ],
)  # fmt: skip
def test_a_bad_entry_is_refused_naming_the_field(
    pem: dict[str, str], tls: dict[str, Any], message: str
) -> None:
    entry = pools(pem)[0]
    entry["worker_tls"] = {k: v for k, v in {**entry["worker_tls"], **tls}.items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": [entry]})
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize("value", [True, "on", ["a"]])
def test_worker_tls_must_be_a_mapping(pem: dict[str, str], value: object) -> None:
    entry = {"name": "a", "workers": ["127.0.0.1:1"], "worker_tls": value}
    with pytest.raises(ConfigError, match=r"^pools\[0\]\.worker_tls must be a mapping"):
        parse_config({"pools": [entry]})
