"""``deltasync report``: a picture of a run (pipeline/versions/history.py collects the data).

Four panels: the changed fraction per version; the delta's bytes against the full
checkpoint and the raw int32-index + value format; the latency from step-completed to
delta-available and to the last replica applied; each replica's lag over time. As a
PNG, or (``--html``) a self-contained page with the picture and the table inlined.
matplotlib comes with the ``report`` extra.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.versions.history import RunReport

# Fixed colours (the tests read them back): the series, then one per replica in name order.
COLOURS = ("#1f77b4", "#d62728", "#7f7f7f", "#bcbd22", "#ff7f0e")
NODE_COLOURS = ("#2ca02c", "#9467bd", "#8c564b", "#17becf", "#e377c2")
WIDTH_IN, HEIGHT_IN, DPI = 12.0, 9.0, 100


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "deltasync report needs matplotlib: pip install 'deltasync[report]'"
        ) from None
    return Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")


def render_png(report: RunReport) -> bytes:
    """The four panels as PNG bytes (the Agg canvas: no display, no global backend)."""
    if not report.versions:
        raise ConfigError(f"run {report.run} has no published version in its event stream")
    fig = _figure()
    (changed, sizes), (latency, lag) = fig.subplots(2, 2)
    versions = [r.version for r in report.versions]
    deltas = [r for r in report.versions if r.kind == "delta"]

    changed.bar(
        [r.version for r in deltas],
        [100 * (r.changed_fraction or 0.0) for r in deltas],
        color=COLOURS[0],
    )
    changed.set(title="Changed elements per version", xlabel="version", ylabel="% changed")

    sizes.plot([r.version for r in deltas], [r.bytes for r in deltas], "o-", color=COLOURS[0],
               label="delta")  # fmt: skip
    sizes.plot([r.version for r in deltas], [report.raw_bytes(r) for r in deltas], "s--",
               color=COLOURS[4], label="raw (int32 index + value)")  # fmt: skip
    if report.full_bytes:
        sizes.axhline(report.full_bytes, color=COLOURS[2], label="full checkpoint")
    anchors = [r for r in report.versions if r.kind == "anchor" or r.anchored]
    if anchors:
        sizes.plot([r.version for r in anchors], [report.full_bytes or r.bytes for r in anchors],
                   "D", color=COLOURS[3], label="anchor")  # fmt: skip
    sizes.set_yscale("log")
    sizes.set(title="Bytes per version", xlabel="version", ylabel="bytes")
    sizes.legend(loc="best", fontsize="small")

    latency.plot(versions, [_nan(r.available_s) for r in report.versions], "o-",
                 color=COLOURS[0], label="step-completed → delta-available")  # fmt: skip
    latency.plot(versions, [_nan(r.synced_s) for r in report.versions], "s-",
                 color=COLOURS[1], label="step-completed → last replica applied")  # fmt: skip
    latency.set(title="Sync latency", xlabel="version", ylabel="seconds")
    latency.set_ylim(bottom=0)
    latency.legend(loc="best", fontsize="small")

    start = min(r.step_at or r.available_at for r in report.versions if r.available_at)
    for i, node in enumerate(report.nodes):
        points = report.lag[node]
        lag.step([(t - start).total_seconds() for t, _ in points], [v for _, v in points],
                 where="post", color=NODE_COLOURS[i % len(NODE_COLOURS)], linewidth=2.5,
                 label=node)  # fmt: skip
    lag.set(title="Replica lag", xlabel="seconds since the first step", ylabel="versions behind")
    lag.set_ylim(bottom=0)
    if report.nodes:
        lag.legend(loc="best", fontsize="small")
    fig.suptitle(f"deltasync run {report.run}: {len(report.versions)} versions")
    out = io.BytesIO()
    fig.savefig(out, format="png", facecolor="white")
    return out.getvalue()


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def render_html(report: RunReport) -> str:
    """One page, nothing external: the PNG inlined as data, then the table."""
    png = base64.b64encode(render_png(report)).decode()
    rows = []
    for r in report.versions:
        cells = (
            str(r.version),
            r.kind + (" (+anchor)" if r.anchored and r.kind == "delta" else ""),
            _fmt(None if r.changed_fraction is None else 100 * r.changed_fraction, "{:.3f}%"),
            f"{r.bytes:,}",
            _fmt(r.bytes / report.full_bytes if report.full_bytes else None, "{:.4f}"),
            _fmt(
                r.bytes / report.raw_bytes(r) if r.kind == "delta" and r.changed else None, "{:.3f}"
            ),
            _fmt(r.available_s, "{:.3f}"),
            _fmt(r.synced_s, "{:.3f}"),
            str(len(r.applied_at)),
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = ("version", "kind", "changed", "bytes", "/full", "/raw", "available s", "synced s",
            "replicas")  # fmt: skip
    title = html.escape(f"deltasync run {report.run}")
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;"
        "text-align:right}</style></head><body>"
        f"<h1>{title}</h1><img alt='charts of the run' src='data:image/png;base64,{png}'>"
        f"<p>{report.events} events; full checkpoint {report.full_bytes:,} bytes; "
        "/full: delta bytes over the full checkpoint; /raw: over an int32 index and a value "
        "per changed element.</p>"
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
        + "".join(rows) + "</table></body></html>\n"
    )  # fmt: skip


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def write_report(report: RunReport, out: Path, *, as_html: bool) -> Path:
    if as_html:
        out.write_text(render_html(report))
    else:
        out.write_bytes(render_png(report))
    return out
