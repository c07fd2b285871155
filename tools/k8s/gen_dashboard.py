"""Write the chart's Grafana dashboard (helm/kvflow/dashboards/kvflow.json) from the panel
list in dashboard_panels.py: a list is reviewable, 1,500 lines of Grafana JSON are not.

python tools/k8s/gen_dashboard.py          regenerate
python tools/k8s/gen_dashboard.py --check  fail (exit 1) when the committed file is stale

Every series it queries is one the chart's PodMonitors scrape (job, namespace, pod, pool,
role labels); tests/k8s/test_observability.py checks each metric name against the code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dashboard_panels import ROWS, Panel

TARGET = Path(__file__).resolve().parents[2] / "helm" / "kvflow" / "dashboards" / "kvflow.json"
UID = "kvflow-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PANEL_WIDTH, PANEL_HEIGHT, PER_ROW = 8, 8, 3  # Grafana's grid is 24 units wide


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": PANEL_WIDTH, "h": PANEL_HEIGHT},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "custom": {"stacking": {"mode": "normal" if panel.stack else "none"}},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": name, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": name}, "definition": query,
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }  # fmt: skip


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for title, row in ROWS.items():
        panels.append({"id": panel_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})  # fmt: skip
        panel_id, y = panel_id + 1, y + 1
        for i, panel in enumerate(row):
            x = (i % PER_ROW) * PANEL_WIDTH
            panels.append(panel_json(panel, panel_id, x, y + (i // PER_ROW) * PANEL_HEIGHT))
            panel_id += 1
        y += -(-len(row) // PER_ROW) * PANEL_HEIGHT
    return {
        "uid": UID,
        "title": "kvflow",
        "description": "kvflow gateways and engine workers, per pool (docs/observability.md)",
        "tags": ["kvflow", "llm-serving"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("namespace", "label_values(kvflow_router_requests_total, namespace)"),
                variable(
                    "pool",
                    'label_values(kvflow_router_requests_total{namespace=~"$namespace"}, pool)',
                ),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"stale: {TARGET} (run python tools/k8s/gen_dashboard.py)", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text)
    print(TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
