"""`report.html`: the comparison's table and plots in one self-contained page (the plots inlined as
base64 PNGs), to mail or attach without the folder around it."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from jinja2 import Environment

from iterserve.bench.report import TABLE_HEADER, ModeRun, table_rows

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>iterserve compare: static vs continuous batching</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; color: #202124; max-width: 1100px; margin: 24px auto; padding: 0 16px; }
table { border-collapse: collapse; margin: 12px 0 24px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #dadce0; text-align: right; }
th:first-child, td:first-child, th:last-child, td:last-child { text-align: left; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; color: #5f6368; }
dd { margin: 0; font-family: ui-monospace, monospace; }
img { max-width: 100%; border: 1px solid #dadce0; margin: 8px 0 16px; }
</style></head>
<body>
<h1>Static vs continuous batching</h1>
<dl>{% for key, value in meta %}<dt>{{ key }}</dt><dd>{{ value }}</dd>{% endfor %}</dl>
<table>
<tr>{% for h in header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for cell in row %}<td>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% for name, data in plots %}<h2>{{ name }}</h2>
<img alt="{{ name }}" src="data:image/png;base64,{{ data }}">
{% endfor %}
</body></html>
"""

META_KEYS = ("command", "date", "commit", "host", "model", "workload", "num_requests", "loadavg_at_start")


def render_html_report(runs: dict[str, ModeRun], meta: dict[str, Any], plots: list[Path]) -> str:
    env = Environment(autoescape=True)
    images = [(p.stem.replace("_", " "), base64.b64encode(p.read_bytes()).decode()) for p in plots]
    meta_rows = [(k.replace("_", " "), _text(meta[k])) for k in META_KEYS if meta.get(k) is not None]
    return env.from_string(TEMPLATE).render(meta=meta_rows, header=TABLE_HEADER,
                                            rows=table_rows(runs["static"], runs["continuous"]), plots=images)


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return " ".join(_text(v) for v in value)
    return str(value)
