"""The dashboard's panels, row by row: the reviewable list `gen_dashboard.py` renders into
Grafana JSON. Each row is a module of dashboard_rows/; the queries' shared pieces are in
dashboard_query.py. Every series queried is one the chart's PodMonitors scrape (job,
namespace, pod, pool, role labels); tests/k8s/test_observability.py checks each metric name
against the code.
"""

from __future__ import annotations

from dashboard_query import Panel
from dashboard_rows import disaggregation, gateway, gpus, overload, protection, tenants, workers

__all__ = ["ROWS", "Panel"]

# Dashboard order: what tenants see first, then the devices behind it, then the why.
ROWS: dict[str, list[Panel]] = {
    row.TITLE: row.PANELS
    for row in (gateway, gpus, overload, protection, tenants, disaggregation, workers)
}
