"""Grafana dashboard building blocks: query targets, panel kinds, query variables, layout.

gen_dashboard.py composes the distmon dashboard from these. Panel constructors leave
``id`` and ``gridPos`` as None; layout() numbers and places them, so no row writes a
grid position by hand. Keys are in the order Grafana exports them (the committed JSON's).
"""

from __future__ import annotations

from typing import NamedTuple

DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24  # columns of Grafana's grid

# (colour, lower bound) steps, the first bound None
Thresholds = list[tuple[str, float | None]]


def target(
    expr: str, legend: str = "", ref: str = "A", *, fmt: str = "time_series", instant: bool = False
) -> dict:
    """One Prometheus query of a panel, on the ``datasource`` variable.

    >>> t = target("up", fmt="table", instant=True)
    >>> t["datasource"]["uid"], t["legendFormat"], t["range"]
    ('${datasource}', '__auto', False)
    """
    return {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "range": not instant,
        "legendFormat": legend or "__auto",
        "refId": ref,
    }


def targets(*specs: tuple[str, str]) -> list[dict]:
    """Targets from (expr, legend) pairs, with refIds A, B, C, ...

    >>> [(t["refId"], t["legendFormat"]) for t in targets(("up", "up"), ("down", ""))]
    [('A', 'up'), ('B', '__auto')]
    """
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(specs)]


def _steps(thresholds: Thresholds | None) -> list[dict]:
    return [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]


def _panel(kind: str, title: str, description: str, tgts: list[dict], **body: object) -> dict:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "id": None,
        "gridPos": None,
        "datasource": DS,
        "targets": tgts,
        **body,
    }


def timeseries(
    title: str,
    tgts: list[dict],
    *,
    unit: str = "short",
    log: bool = False,
    description: str = "",
    draw: str = "line",
    thresholds: Thresholds | None = None,
    overrides: list[dict] | None = None,
) -> dict:
    """A time series panel; ``thresholds`` (colour, from value) are drawn as lines.

    >>> p = timeseries("norm", targets(("up", "")), log=True, thresholds=[("green", None), ("red", 10)])
    >>> p["fieldConfig"]["defaults"]["custom"]["scaleDistribution"], p["id"], p["gridPos"]
    ({'type': 'log', 'log': 10}, None, None)
    """
    custom = {
        "drawStyle": draw,
        "lineWidth": 1,
        "fillOpacity": 60 if draw == "bars" else 0,
        "pointSize": 4,
        "showPoints": "never",
        "spanNulls": False,
        "axisPlacement": "auto",
        "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
        "thresholdsStyle": {"mode": "line" if thresholds else "off"},
    }
    return _panel(
        "timeseries",
        title,
        description,
        tgts,
        fieldConfig={
            "defaults": {
                "unit": unit,
                "custom": custom,
                "color": {"mode": "palette-classic"},
                "thresholds": {"mode": "absolute", "steps": _steps(thresholds)},
            },
            "overrides": overrides or [],
        },
        options={
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    )


def stat(
    title: str,
    tgt: dict,
    *,
    unit: str = "short",
    description: str = "",
    thresholds: Thresholds | None = None,
    text_mode: str = "auto",
) -> dict:
    """A single-value panel showing the last value, coloured by ``thresholds``.

    >>> stat("steps", target("up"), unit="s")["fieldConfig"]["defaults"]["unit"]
    's'
    """
    return _panel(
        "stat",
        title,
        description,
        [tgt],
        fieldConfig={
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": _steps(thresholds)},
            },
            "overrides": [],
        },
        options={
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": text_mode,
        },
    )


def heatmap(
    title: str,
    tgt: dict,
    *,
    description: str = "",
    y_unit: str = "short",
    reverse: bool = False,
    scale: str = "exponential",
) -> dict:
    """A heatmap of pre-bucketed series (Grafana does not re-bucket: ``calculate`` is off).

    >>> heatmap("norms", target("up", fmt="heatmap"), reverse=True)["options"]["yAxis"]["reverse"]
    True
    """
    return _panel(
        "heatmap",
        title,
        description,
        [tgt],
        fieldConfig={
            "defaults": {
                "custom": {
                    "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"},
                }
            },
            "overrides": [],
        },
        options={
            "calculate": False,
            "cellGap": 1,
            "color": {
                "mode": "scheme",
                "scheme": "Spectral",
                "reverse": True,
                "scale": scale,
                "exponent": 0.5,
                "steps": 64,
                "fill": "dark-orange",
            },
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
            "yAxis": {"axisPlacement": "left", "reverse": reverse, "unit": y_unit},
            "cellValues": {},
            "showValue": "never",
        },
    )


ALERT_COLUMNS = ("alertname", "severity", "run_id")
ALERT_HIDDEN = ("Time", "Value", "__name__", "job", "alertstate")


def table(
    title: str,
    tgt: dict,
    *,
    description: str = "",
    first: tuple[str, ...] = ALERT_COLUMNS,
    hidden: tuple[str, ...] = ALERT_HIDDEN,
    rename: dict[str, str] | None = None,
    sort_desc: str | None = None,
) -> dict:
    """A table of series, one row each: the ``first`` columns leftmost, ``hidden`` ones left out,
    columns renamed by ``rename``, rows sorted by column ``sort_desc`` (its shown name),
    largest first. The defaults make a table of alert series (time and value hidden).

    >>> table("alerts", target("ALERTS", fmt="table", instant=True))["transformations"][0]["id"]
    'organize'
    >>> t = table("top", target("up", fmt="table", instant=True), first=("rank",), hidden=("Time",),
    ...           rename={"Value": "z"}, sort_desc="z")
    >>> t["options"]["sortBy"], t["transformations"][0]["options"]["renameByName"]
    ([{'displayName': 'z', 'desc': True}], {'Value': 'z'})
    """
    options: dict[str, object] = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    if sort_desc:
        options["sortBy"] = [{"displayName": sort_desc, "desc": True}]
    return _panel(
        "table",
        title,
        description,
        [tgt],
        fieldConfig={"defaults": {"custom": {"align": "auto"}}, "overrides": []},
        options=options,
        transformations=[
            {
                "id": "organize",
                "options": {
                    "excludeByName": dict.fromkeys(hidden, True),
                    "indexByName": {name: i for i, name in enumerate(first)},
                    "renameByName": rename or {},
                },
            }
        ],
    )


# --------------------------------------------------------------------------------------------
# Layout: a dashboard is a list of Rows, a Row a title over Lines, a Line panels side by side.


class Line(NamedTuple):
    """Panels side by side, sharing the grid's 24 columns equally, all ``height`` units tall."""

    height: int
    panels: tuple[dict, ...]


def line(height: int, *panels: dict) -> Line:
    """A Line; the panel count must divide the grid width, so every panel gets the same width.

    >>> line(8, {}, {}, {}).height
    8
    >>> line(8, *[{}] * 5)
    Traceback (most recent call last):
    ValueError: 5 panels do not share 24 columns equally; use a divisor of 24
    """
    if not panels or WIDTH % len(panels):
        raise ValueError(
            f"{len(panels)} panels do not share {WIDTH} columns equally; use a divisor of {WIDTH}"
        )
    return Line(height, panels)


class Row(NamedTuple):
    """A titled dashboard row and its lines of panels, top to bottom."""

    title: str
    lines: list[Line]


def layout(rows: list[Row]) -> list[dict]:
    """The dashboard's panel list: each row header, then its lines, stacked from y = 0 down.

    Panels are numbered 1, 2, 3, ... in that order, row headers included.

    >>> panels = layout([Row("R", [line(3, {}), line(2, {}, {})])])
    >>> [(p["id"], p.get("type"), *p["gridPos"].values()) for p in panels]
    [(1, 'row', 0, 0, 24, 1), (2, None, 0, 1, 24, 3), (3, None, 0, 4, 12, 2), (4, None, 12, 4, 12, 2)]
    """
    placed: list[dict] = []
    y = 0
    for r in rows:
        placed.append(
            {
                "type": "row",
                "title": r.title,
                "id": None,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": WIDTH, "h": 1},
                "panels": [],
            }
        )
        y += 1
        for ln in r.lines:
            w = WIDTH // len(ln.panels)
            placed += [
                {**p, "gridPos": {"x": i * w, "y": y, "w": w, "h": ln.height}}
                for i, p in enumerate(ln.panels)
            ]
            y += ln.height
    return [{**p, "id": i} for i, p in enumerate(placed, 1)]


def query_variable(name: str, label: str, query: str, *, sort: int, multi: bool = False) -> dict:
    """A Prometheus query variable; ``multi`` makes it multi-select with an "All" of ``.*``.

    >>> var = query_variable("layer", "Layer", "label_values(up, layer)", sort=0, multi=True)
    >>> var["includeAll"], var["allValue"], var["multi"]
    (True, '.*', True)
    """
    var = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "sort": sort,
        "regex": "",
        "hide": 0,
        "current": {},
        "options": [],
        "includeAll": multi,
    }
    if multi:
        var["allValue"] = ".*"
    return {**var, "multi": multi}
