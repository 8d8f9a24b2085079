"""The HTML report of a loop run: one self-contained folder, ``report.html`` and the PNGs it shows.

``render_report`` takes the document ``run_trace`` returns (``agents/_run.py``) and, optionally, what the
document does not carry: the stored proposals (for their diffs), the run's latencies, the KV requests' token
counts and the PNGs diagnosis drew. It writes, beside ``report.html``:

- ``hit-ratio.png``: the hit ratio per window, the policy version in force as shaded spans (a line and a label
  where it changes), canary windows hatched, the window the drift was detected in marked, phases labelled;
- the finding plots given, copied in (granger, drift and change-point ones first), and a table of every
  window's findings;
- ``latency.png``: the latency histogram, on a log axis when the values span more than ``LOG_SPAN``;
- ``kv-heatmap.png``: per window and token-position bin, the share of the tokens asked for there that the KV
  cache served (``kv_heatmap``);
- the promoted proposals' diffs, a table of every proposal and the canary breaches.

Links are relative, so the folder can be moved; there is no script and nothing is fetched. Every text taken
from the data (summaries, diffs, reasons, ids) is HTML-escaped. Each file is written to a temporary file in
the folder and renamed over the old one, so a reader never sees half a report. matplotlib is imported inside
the drawing functions and draws on an Agg canvas (no pyplot), as the finding plots are.
"""

from __future__ import annotations

import html
import io
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._proposals import Proposal

REPORT_NAME = "report.html"
HEATMAP_BINS = 16
LOG_SPAN = 100.0
"""Latencies whose largest is more than this many times the smallest are drawn on a log axis."""
FIRST_PLOT_KINDS = ("granger", "key-drift", "mix-drift", "change-point")
"""Finding plots of these kinds come first: what caused the misses and when the workload moved."""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True, slots=True)
class KvHeatmap:
    """The KV hit shares by window and token position. ``windows``: the rows (window indices, ascending);
    ``edges``: the bins' token-position edges, bin ``b`` covering positions ``edges[b] <= p < edges[b + 1]``;
    ``asked[w, b]``: over the positions of bin ``b``, the number of (request, position) pairs of window
    ``windows[w]`` asked for; ``hits[w, b]``: those served from cache."""

    windows: tuple[int, ...]
    edges: tuple[int, ...]
    asked: np.ndarray
    hits: np.ndarray

    @property
    def share(self) -> np.ndarray:
        """``hits / asked``, NaN where nothing was asked: per position, the share of the requests asking for
        it that were served from cache, averaged over the bin's positions weighted by how many asked."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.asked > 0, self.hits / np.maximum(self.asked, 1), np.nan)

    @property
    def empty(self) -> bool:
        return not self.asked.size or not self.asked.any()


def kv_heatmap(kv_positions: Iterable[tuple[int, int, int]], bins: int = HEATMAP_BINS) -> KvHeatmap:
    """Bin KV requests ``(window, prompt_tokens, cached_tokens)`` by token position: position ``p`` of a
    request is asked for when ``p < prompt_tokens`` and a hit when ``p < cached_tokens``. The positions
    ``0 .. max prompt_tokens`` are cut into ``bins`` bins of equal width (fewer when the longest prompt has
    fewer tokens than ``bins``; integer edges ``i * max // bins``). Empty input, or prompts of no tokens, give
    an empty heat map. Raises ``ValueError`` naming the entry for negative counts, more cached tokens than
    prompt tokens, or ``bins`` below 1."""
    if bins < 1:
        raise ValueError(f"bins {bins} is below 1")
    rows = [_kv_entry(i, entry) for i, entry in enumerate(kv_positions)]
    windows = tuple(sorted({w for w, _, _ in rows}))
    longest = max((prompt for _, prompt, _ in rows), default=0)
    n = min(bins, longest)
    edges = np.array([i * longest // n for i in range(n + 1)] if n else [0], dtype=np.int64)
    lo, hi = edges[:-1], edges[1:]
    asked = np.zeros((len(windows), n), dtype=np.int64)
    hits = np.zeros((len(windows), n), dtype=np.int64)
    row_of = {w: i for i, w in enumerate(windows)}
    for window, prompt, cached in rows:
        # the positions of [0, tokens) that fall in each bin [lo, hi)
        asked[row_of[window]] += np.clip(np.minimum(prompt, hi) - lo, 0, None)
        hits[row_of[window]] += np.clip(np.minimum(cached, hi) - lo, 0, None)
    return KvHeatmap(windows, tuple(int(e) for e in edges), asked, hits)


def _kv_entry(i: int, entry: tuple[int, int, int]) -> tuple[int, int, int]:
    try:
        window, prompt, cached = (int(v) for v in entry)
    except (TypeError, ValueError):
        raise ValueError(f"kv_positions[{i}]: {entry!r} is not (window, prompt_tokens, cached_tokens)"
                         ) from None
    if window < 0 or prompt < 0 or cached < 0:
        raise ValueError(f"kv_positions[{i}]: {entry!r} has a negative count")
    if cached > prompt:
        raise ValueError(f"kv_positions[{i}]: {cached} cached tokens of a {prompt}-token prompt")
    return window, prompt, cached


def render_report(report: Mapping[str, Any], out_dir: str | Path, *, proposals: Sequence[Proposal] = (),
                  latencies_ms: Sequence[float] = (), kv_positions: Sequence[tuple[int, int, int]] = (),
                  finding_plots: Sequence[str | Path] = (), title: str = "evocache loop") -> Path:
    """Write ``out_dir/report.html`` (``out_dir`` created if missing) and its PNGs beside it; return the
    HTML's path. ``report``: the ``run_trace`` document; ``proposals``: stored proposals, whose diffs are
    shown for those promoted; ``latencies_ms``: one per request; ``kv_positions``: ``(window, prompt_tokens,
    cached_tokens)`` per KV request; ``finding_plots``: PNGs to copy in. Raises ``ValueError`` naming what is
    wrong for a report without ``windows``, a window without its fields, a negative or non-finite latency, a
    bad KV entry, or a finding plot that is missing or not a PNG."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    windows = _windows(report)
    sections = [
        _header(title, report, windows),
        _hit_ratio_section(windows, report.get("drift_detected_at"), out),
        _findings_section(windows, finding_plots, out),
        _latency_section(latencies_ms, out),
        _heatmap_section(kv_positions, out),
        _proposals_section(report, proposals),
    ]
    page = _PAGE.format(title=_esc(title), style=_STYLE, body="\n".join(sections))
    path = out / REPORT_NAME
    _write_atomic(path, page.encode("utf-8"))
    return path


# --- the report document ------------------------------------------------------------------------------------

_WINDOW_FIELDS = ("index", "policy", "hit_ratio")


def _windows(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if "windows" not in report:
        raise ValueError("report: no 'windows'")
    windows = list(report["windows"])
    for i, w in enumerate(windows):
        missing = [k for k in _WINDOW_FIELDS if k not in w]
        if missing:
            raise ValueError(f"report windows[{i}]: no {', '.join(repr(k) for k in missing)}")
    return sorted(windows, key=lambda w: int(w["index"]))


def _count(report: Mapping[str, Any], status: str) -> int:
    return sum(1 for p in report.get("proposals", ()) if p.get("status") == status)


def _header(title: str, report: Mapping[str, Any], windows: Sequence[Mapping[str, Any]]) -> str:
    drift = report.get("drift_detected_at")
    requests = sum(int(w.get("requests", 0) or 0) for w in windows)
    facts = [("windows", str(len(windows))), ("requests", str(requests)),
             ("drift detected at", "none" if drift is None else f"window {drift}"),
             ("proposals", str(len(report.get("proposals", ())))),
             ("promoted", str(_count(report, "promoted"))),
             ("rolled back", str(_count(report, "rolled_back")))]
    if report.get("capacity") is not None:
        facts.append(("L1 capacity", str(report["capacity"])))
    if windows:
        facts.append(("policy at the end", str(windows[-1]["policy"])))
    items = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in facts)
    return f"<h1>{_esc(title)}</h1>\n<dl class=\"summary\">{items}</dl>"


# --- 1. hit ratio over time ---------------------------------------------------------------------------------

def _runs(values: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """Consecutive runs of equal values: ``(first position, last position, value)``."""
    runs: list[tuple[int, int, Any]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][2] == v:
            runs[-1] = (runs[-1][0], i, v)
        else:
            runs.append((i, i, v))
    return runs


def _hit_ratio_section(windows: Sequence[Mapping[str, Any]], drift: int | None, out: Path) -> str:
    head = "<h2>Hit ratio per window</h2>"
    if not windows:
        return head + "\n<p class=\"note\">No windows in the report.</p>"
    fig, ax = _figure(9, 4.0)
    x = np.array([int(w["index"]) for w in windows], dtype=float)
    y = np.array([np.nan if w["hit_ratio"] is None else float(w["hit_ratio"]) for w in windows])
    policies = _runs([str(w["policy"]) for w in windows])
    _mark_policies(ax, x, policies)
    _mark_canaries(ax, x, _runs([w.get("canary") for w in windows]))
    _mark_phases(ax, x, _runs(["+".join(w.get("phases") or ()) for w in windows]))
    ax.plot(x, y, marker="o", markersize=3, color="C0", label="hit ratio", zorder=3)
    if drift is not None:
        ax.axvline(float(drift), color="C3", linestyle="--", label=f"drift detected (window {drift})")
    ax.set_xlim(x[0] - 0.5, x[-1] + 0.5)
    ax.set_ylim(0, max(1.0, float(np.nanmax(y)) if np.isfinite(y).any() else 1.0) * 1.12)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("window")
    ax.set_ylabel("hit ratio")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    name = _save(fig, out, "hit-ratio.png")
    versions = ", ".join(
        _esc(f"{ref} (window {int(x[a])})" if a == b else f"{ref} (windows {int(x[a])}\u2013{int(x[b])})")
        for a, b, ref in policies)
    return (f"{head}\n{_img(name, 'hit ratio per window')}\n<p>Policies in force: {versions}. Shaded spans: "
            "the policy version in force; hatched: a canary ran; dashed red line: the drift detected.</p>")


def _mark_policies(ax: Any, x: np.ndarray, runs: Sequence[tuple[int, int, str]]) -> None:
    """A shaded span per policy version in force, a line where it changes, its version at the top."""
    top = ax.get_xaxis_transform()  # x in data, y in axes coordinates
    for n, (a, b, ref) in enumerate(runs):
        ax.axvspan(x[a] - 0.5, x[b] + 0.5, color=f"C{n % 10}", alpha=0.08, linewidth=0)
        if n:
            ax.axvline(x[a] - 0.5, color="0.35", linewidth=0.8)
        ax.text(x[a] - 0.42, 0.97, _version(ref), transform=top, fontsize=8, fontweight="bold", va="top")


def _mark_canaries(ax: Any, x: np.ndarray, runs: Sequence[tuple[int, int, str | None]]) -> None:
    """A hatched band along the top for each run of windows with a canary, its version beside it."""
    top, label = ax.get_xaxis_transform(), "canary"
    for a, b, ref in runs:
        if ref is None:
            continue
        ax.axvspan(x[a] - 0.5, x[b] + 0.5, ymin=0.0, ymax=1.0, facecolor="none", edgecolor="C1", alpha=0.45,
                   hatch="///", linewidth=0, label=label)
        ax.text(x[a] - 0.42, 0.89, f"canary {_version(ref)}", transform=top, fontsize=7, color="C1", va="top")
        label = "_nolegend_"  # one legend entry for all canary spans


def _mark_phases(ax: Any, x: np.ndarray, runs: Sequence[tuple[int, int, str]]) -> None:
    """The trace's phases, written along the bottom where each begins."""
    bottom = ax.get_xaxis_transform()
    for a, _, phase in runs:
        if phase:
            ax.text(x[a] - 0.42, 0.03, phase, transform=bottom, fontsize=7, color="0.3", style="italic")


def _version(ref: str) -> str:
    """``v3`` for ``name@3``; the ref itself without a version."""
    name, at, version = ref.rpartition("@")
    return f"v{version}" if at and version else ref


# --- 2. findings --------------------------------------------------------------------------------------------

def _plot_kind(path: Path) -> str | None:
    """The finding kind of a plot named as ``plot_finding`` names them (``<kind>-w<window>-<digest>.png``)."""
    match = re.match(r"^(.+)-w\d+-[0-9a-f]+\.png$", path.name)
    return match.group(1) if match else None


def _findings_section(windows: Sequence[Mapping[str, Any]], finding_plots: Sequence[str | Path],
                      out: Path) -> str:
    parts = ["<h2>Findings</h2>"]
    plots = sorted((Path(p) for p in finding_plots), key=lambda p: _plot_kind(p) not in FIRST_PLOT_KINDS)
    if plots:
        figures = []
        for i, src in enumerate(plots):
            name = _copy_png(src, out, f"finding-{i:02d}-{_SAFE_NAME.sub('_', src.name)}")
            caption = f"<figcaption>{_esc(src.name)}</figcaption>"
            figures.append(f"<figure>{_img(name, src.name)}{caption}</figure>")
        parts.append("<div class=\"plots\">" + "\n".join(figures) + "</div>")
    else:
        parts.append("<p class=\"note\">No finding plots given.</p>")
    rows = [(w["index"], f) for w in windows for f in w.get("findings", ())]
    if rows:
        body = "".join(
            f"<tr><td>{_esc(i)}</td><td>{_esc(f.get('kind', ''))}</td><td>{_num(f.get('score'), '.3f')}</td>"
            f"<td>{_num(f.get('p_value'), '.3g')}</td><td>{_esc(f.get('summary', ''))}</td></tr>"
            for i, f in rows)
        parts.append("<table><thead><tr><th>window</th><th>kind</th><th>score</th><th>p-value</th>"
                     f"<th>summary</th></tr></thead><tbody>{body}</tbody></table>")
    else:
        parts.append("<p class=\"note\">No findings in any window.</p>")
    return "\n".join(parts)


def _copy_png(src: Path, out: Path, name: str) -> str:
    try:
        data = src.read_bytes()
    except OSError as exc:
        raise ValueError(f"finding plot {src}: cannot be read ({exc.strerror or exc})") from None
    if not data.startswith(PNG_MAGIC):
        raise ValueError(f"finding plot {src}: not a PNG")
    _write_atomic(out / name, data)
    return name


# --- 3. latency ---------------------------------------------------------------------------------------------

def _latency_section(latencies_ms: Sequence[float], out: Path) -> str:
    head = "<h2>Latency</h2>"
    lat = np.asarray(list(latencies_ms), dtype=float)
    if not lat.size:
        return head + "\n<p class=\"note\">No latencies given: no histogram.</p>"
    bad = np.flatnonzero(~np.isfinite(lat) | (lat < 0))
    if bad.size:
        raise ValueError(f"latencies_ms[{bad[0]}]: {lat[bad[0]]} is not a finite, non-negative latency")
    positive = lat[lat > 0]
    log = positive.size > 1 and positive.size == lat.size and positive.max() / positive.min() > LOG_SPAN
    fig, ax = _figure(7, 3.4)
    if log:
        edges = np.geomspace(positive.min(), positive.max(), 41)
        ax.set_xscale("log")
    else:
        edges = np.linspace(lat.min(), lat.max(), 41) if np.ptp(lat) > 0 else 1
    ax.hist(lat, bins=edges, color="C0")
    p50, p95, p99 = np.percentile(lat, [50, 95, 99])
    for value, label, color in ((p50, "p50", "C2"), (p95, "p95", "C1"), (p99, "p99", "C3")):
        ax.axvline(value, color=color, linestyle="--", linewidth=1, label=f"{label} {value:.1f} ms")
    ax.set_xlabel("latency (ms)" + (", log scale" if log else ""))
    ax.set_ylabel("requests")
    ax.legend(fontsize=7)
    name = _save(fig, out, "latency.png")
    return (f"{head}\n{_img(name, 'latency histogram')}\n<p>{lat.size} requests; p50 {p50:.1f} ms, p95 "
            f"{p95:.1f} ms, p99 {p99:.1f} ms, max {lat.max():.1f} ms{' (log scale)' if log else ''}.</p>")


# --- 4. KV heat map -----------------------------------------------------------------------------------------

def _heatmap_section(kv_positions: Sequence[tuple[int, int, int]], out: Path) -> str:
    head = "<h2>KV hits by token position</h2>"
    heat = kv_heatmap(kv_positions)
    if heat.empty:
        return head + "\n<p class=\"note\">No KV requests given: no heat map.</p>"
    share = np.ma.masked_invalid(heat.share)
    fig, ax = _figure(8, max(2.4, 0.9 + 0.28 * len(heat.windows)))
    cmap = _cmap()
    image = ax.imshow(share, aspect="auto", origin="lower", cmap=cmap, vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    n = len(heat.edges) - 1
    ax.set_xticks(np.arange(n + 1) - 0.5, [str(e) for e in heat.edges], fontsize=6)
    step = max(1, len(heat.windows) // 20)
    ax.set_yticks(np.arange(0, len(heat.windows), step), [str(w) for w in heat.windows[::step]], fontsize=7)
    ax.set_xlabel("token position")
    ax.set_ylabel("window")
    fig.colorbar(image, ax=ax, label="share served from cache")
    name = _save(fig, out, "kv-heatmap.png")
    requests = len(kv_positions)
    return (f"{head}\n{_img(name, 'KV hit share by window and token position')}\n<p>{requests} KV requests. "
            "Each cell: of the requests of that window asking for a token in that position bin, the share of "
            "those tokens served from cache. Grey: no request reached that far.</p>")


def _cmap() -> Any:
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="0.85")


# --- 5. proposals and breaches ------------------------------------------------------------------------------

def _proposals_section(report: Mapping[str, Any], proposals: Sequence[Proposal]) -> str:
    parts = ["<h2>Promoted changes</h2>"]
    promoted = [p for p in proposals if p.status == "promoted"]
    known = {p.id for p in promoted}
    for p in promoted:
        parts.append(f"<h3>{_esc(p.id)}: {_esc(p.base_policy)} &rarr; {_esc(p.new_ref)}</h3>\n"
                     f"<p>Predicted gain {_num(p.predicted_gain, '+.4f')}, realised gain "
                     f"{_num(p.realised_gain, '+.4f')}.</p>\n<pre class=\"diff\">{_esc(p.diff)}</pre>")
    missing = [str(p.get("id")) for p in report.get("proposals", ())
               if p.get("status") == "promoted" and p.get("id") not in known]
    if missing:
        parts.append(f"<p class=\"note\">Promoted, diff not given: {_esc(', '.join(missing))}.</p>")
    if not promoted and not missing:
        parts.append("<p class=\"note\">No change was promoted.</p>")
    parts.append("<h2>Proposals</h2>")
    rows = report.get("proposals", ())
    if rows:
        body = "".join(
            f"<tr><td>{_esc(p.get('id', ''))}</td><td>{_esc(p.get('window', ''))}</td>"
            f"<td class=\"status-{_esc(p.get('status', ''))}\">{_esc(p.get('status', ''))}</td>"
            f"<td>{_num(p.get('predicted_gain'), '+.4f')}</td>"
            f"<td>{_num(p.get('realised_gain'), '+.4f')}</td></tr>"
            for p in rows)
        parts.append("<table><thead><tr><th>id</th><th>window</th><th>status</th><th>predicted gain</th>"
                     f"<th>realised gain</th></tr></thead><tbody>{body}</tbody></table>")
    else:
        parts.append("<p class=\"note\">No proposals.</p>")
    parts.append("<h2>Canary breaches (rolled back)</h2>")
    breaches = report.get("breaches", ())
    if breaches:
        body = "".join(f"<tr><td>{_esc(b.get('proposal', ''))}</td><td>{_esc(_span(b.get('windows')))}</td>"
                       f"<td>{_esc(_difference(b.get('difference')))}</td>"
                       f"<td>{_esc(b.get('reason', ''))}</td></tr>"
                       for b in breaches)
        parts.append("<table><thead><tr><th>proposal</th><th>windows</th><th>hit ratio difference</th>"
                     f"<th>why</th></tr></thead><tbody>{body}</tbody></table>")
    else:
        parts.append("<p class=\"note\">No canary was rolled back.</p>")
    return "\n".join(parts)


def _span(windows: Any) -> str:
    if isinstance(windows, Sequence) and not isinstance(windows, str) and len(windows) == 2:
        return f"{windows[0]}\u2013{windows[1]}"
    return "" if windows is None else str(windows)


def _difference(diff: Any) -> str:
    if isinstance(diff, Sequence) and not isinstance(diff, str) and len(diff) == 3:
        return f"{float(diff[0]):+.4f} [{float(diff[1]):+.4f}, {float(diff[2]):+.4f}]"
    return "" if diff is None else str(diff)


# --- pieces -------------------------------------------------------------------------------------------------

def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "&ndash;"
    return _esc(format(float(value), spec))


def _img(name: str, alt: str) -> str:
    return f"<img src=\"{_esc(name)}\" alt=\"{_esc(alt)}\">"


def _figure(width: float, height: float) -> tuple[Any, Any]:
    # a Figure on an Agg canvas, no pyplot: nothing global (the backend, pyplot's figure list) changes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    _write_atomic(out / name, buffer.getvalue())
    return name


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` to a temporary file in ``path``'s folder, then renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em;
       color: #222; }
h1 { margin-bottom: 0.3em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
dl.summary { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1.5em; }
dl.summary dt { font-weight: 600; } dl.summary dd { margin: 0; }
img { max-width: 100%; } figure { margin: 0.5em 0; } figcaption { font-size: 12px; color: #555; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
pre.diff { background: #f8f8f8; border: 1px solid #ddd; padding: 0.6em; overflow-x: auto; }
.note { color: #666; font-style: italic; }
.status-promoted { color: #176b2c; } .status-rolled_back { color: #a31515; }
""".strip()

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
{style}
</style>
</head>
<body>
{body}
</body>
</html>
"""
