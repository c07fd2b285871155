"""What the operator's administrator allows: hostPath folders and Prometheus URLs."""

from __future__ import annotations

import pytest

from kvflow.operator.admin_policy import host_path_allowed, prometheus_url_allowed
from kvflow.operator.cli import parse_args


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/models", True),
        ("/models/", True),
        ("/models/llama/8b", True),
        ("/data/models", True),
        ("/models-private", False),  # a sibling that shares the prefix's text
        ("/models/../etc", False),  # normalized: /etc
        ("/", False),
        ("/etc", False),
        ("models", False),  # relative: never
    ],
)
def test_host_paths_only_under_an_allowed_folder(path: str, allowed: bool) -> None:
    assert host_path_allowed(path, ["/models", "/data/models/"]) is allowed


def test_no_allowed_folder_allows_no_host_path() -> None:
    assert not host_path_allowed("/models", [])


BASE = ["http://prometheus-operated.monitoring:9090", "https://thanos.example/prom/"]


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://prometheus-operated.monitoring:9090", True),
        ("http://prometheus-operated.monitoring:9090/", True),
        ("HTTP://Prometheus-Operated.monitoring:9090", True),  # scheme and host: any case
        ("https://thanos.example/prom", True),
        ("https://thanos.example:443/prom/api", True),  # the scheme's default port
        ("https://thanos.example/", False),  # above the allowed path
        ("https://thanos.example/prometheus", False),  # a sibling path
        ("https://thanos.example/prom/../admin", False),  # normalized: /admin
        ("http://thanos.example/prom", False),  # another scheme
        ("http://prometheus-operated.monitoring:90901", False),  # another port
        ("http://prometheus-operated.monitoring", False),  # port 80
        ("http://prometheus-operated.monitoring:9090@169.254.169.254", False),  # user info
        ("http://admin:pw@prometheus-operated.monitoring:9090", False),  # credentials
        ("http://169.254.169.254/latest/meta-data", False),
        ("http://prometheus-operated.monitoring:9090?x=1", False),
        ("ftp://prometheus-operated.monitoring:9090", False),
        ("http://[::1", False),  # unparseable
    ],
)
def test_prometheus_urls_only_at_or_below_an_allowed_base(url: str, allowed: bool) -> None:
    assert prometheus_url_allowed(url, BASE) is allowed


def test_no_allowed_base_allows_no_prometheus() -> None:
    assert not prometheus_url_allowed("http://prometheus-operated.monitoring:9090", [])


def test_settings_that_could_never_match_stop_the_operator_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_args(
        ["--allowed-host-path-prefix", "/models", "--allowed-prometheus-url", "http://p:9090"]
    )
    assert args.allowed_host_path_prefixes == ["/models"]
    for bad in (
        ["--allowed-host-path-prefix", "models"],
        ["--allowed-prometheus-url", "http://user@p:9090"],
        ["--allowed-prometheus-url", "prometheus:9090"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert bad[1] in capsys.readouterr().err
