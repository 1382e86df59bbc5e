"""Charts as inline SVG, drawn on the server: no JavaScript, no network, readable without a browser plug-in.

Every function returns :class:`markupsafe.Markup` (safe to put in a Jinja template); every piece of
text that goes into the SVG is escaped here. Non-finite values, and values a log axis cannot show
(zero, negative), are dropped, so any stored data draws (an empty chart says "no data").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

from api.timeline import Box

PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563",
           "#65a30d", "#ea580c", "#0d9488", "#9333ea"]
_ids = itertools.count(1)
FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'


# -- number formats ------------------------------------------------------------------------------

def fmt_si(v: float) -> str:
    """1.5k, 20M, 3.2G, 0.5m ... (3 significant digits)."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    a = abs(v)
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""), (1e-3, "m"),
                          (1e-6, "µ"), (1e-9, "n")):
        if a >= scale * 0.9995:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.2g}"


def fmt_plain(v: float) -> str:
    """A rate in its axis' own unit (TFLOP/s, GB/s): 3 significant digits, no SI prefix (0.25, not 250m)."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def fmt_bytes(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    for scale, suffix in ((1024**5, "PiB"), (1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if a >= scale:
            return f"{v / scale:.3g} {suffix}"
    return f"{v:.0f} B"


def fmt_seconds(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a == 0:
        return "0 s"
    if a >= 100:
        return f"{v:,.0f} s"
    if a >= 1:
        return f"{v:.3g} s"
    if a >= 1e-3:
        return f"{v * 1e3:.3g} ms"
    return f"{v * 1e6:.3g} µs"


def _f(v: float) -> str:
    """Coordinate: short, no exponent."""
    return f"{v:.1f}".rstrip("0").rstrip(".") if math.isfinite(v) else "0"


def _text(x: float, y: float, s: str, *, anchor: str = "start", size: int = 11, fill: str = "#374151",
          extra: str = "") -> str:
    return (f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" font-size="{size}" fill="{fill}"{extra}>'
            f"{escape(s)}</text>")


def _empty(width: int, height: int, title: str, message: str) -> Markup:
    return Markup(
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{escape(title)}" {FONT}>'
        f'<rect x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" fill="#fafafa" stroke="#e5e7eb"/>'
        + _text(12, 20, title, size=13, fill="#111827", extra=' font-weight="600"')
        + _text(width / 2, height / 2, message, anchor="middle", size=12, fill="#6b7280")
        + "</svg>")


# -- axes ----------------------------------------------------------------------------------------

def _nice_step(span: float, target: int) -> float:
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


@dataclass
class Axis:
    lo: float
    hi: float
    log: bool
    ticks: list[float]

    def frac(self, v: float) -> float:
        if self.log:
            a, b, x = math.log(self.lo), math.log(self.hi), math.log(v)
        else:
            a, b, x = self.lo, self.hi, v
        return 0.5 if b == a else (x - a) / (b - a)


def make_axis(values: Sequence[float], *, log: bool, base: int = 10, zero: bool = False, max_ticks: int = 7,
              unit: float = 1.0) -> Axis:
    """Ticks at powers of ``base`` (log), or at nice multiples of ``unit`` (linear; 1024**k for bytes)."""
    if not log and unit != 1.0:
        a = make_axis([v / unit for v in values], log=False, zero=zero, max_ticks=max_ticks)
        return Axis(a.lo * unit, a.hi * unit, False, [t * unit for t in a.ticks])
    vals = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
    if not vals:
        vals = [1.0, 10.0] if log else [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    if log:
        e_lo = math.floor(math.log(lo, base) + 1e-9)
        e_hi = math.ceil(math.log(hi, base) - 1e-9)
        if e_hi <= e_lo:
            e_hi = e_lo + 1
        n = e_hi - e_lo
        step = next(s for s in (1, 2, 3, 4, 5, 10, 20, 50, 100, 1000) if n / s <= max_ticks - 1)
        e_lo -= e_lo % step if e_lo % step else 0
        ticks = [float(base) ** e for e in range(e_lo, e_hi + 1, step)]
        if ticks[-1] < hi * (1 - 1e-9):
            ticks.append(ticks[-1] * float(base) ** step)
        if base == 10 and step == 1 and len(ticks) <= 3:  # a decade or two: 1-2-5 ticks
            ticks = sorted(t * k for t in ticks[:-1] for k in (1, 2, 5)) + [ticks[-1]]
        return Axis(ticks[0], ticks[-1], True, ticks)
    if zero:
        lo = min(lo, 0.0)
        hi = max(hi, 0.0)
    if hi == lo:
        hi = lo + (abs(lo) or 1.0)
    step = _nice_step(hi - lo, max_ticks - 1)
    t0 = math.floor(lo / step + 1e-9) * step
    t1 = math.ceil(hi / step - 1e-9) * step
    ticks, t = [], t0
    while t <= t1 + step * 1e-6 and len(ticks) < 50:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return Axis(t0, t1, False, ticks)


# -- line / scatter chart ------------------------------------------------------------------------

@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    mode: str = "line"  # "line" | "markers" | "both"
    color: str | None = None
    dashed: bool = False
    labels: list[str] = field(default_factory=list)  # tooltip per point (markers)
    legend: str | None = None  # series sharing a legend name share one entry (a fit and its measured points)


def _entries(series: list[Series]) -> list[tuple[str, str, str]]:
    """One legend entry per series, or per ``legend`` name its series share (drawn as a line with a marker)."""
    entries: list[tuple[str, str, str]] = []
    where: dict[str, int] = {}
    for s in series:
        style = "marker" if s.mode == "markers" else ("dash" if s.dashed else "line")
        key = s.legend or s.name
        if key in where:
            name, color, seen = entries[where[key]]
            entries[where[key]] = (name, color, seen if seen == style else "both")
            continue
        where[key] = len(entries)
        entries.append((key, s.color or "#000", style))
    return entries


def _legend(entries: list[tuple[str, str, str]], x0: float, y0: float, width: float) -> tuple[str, float]:
    """entries (name, color, style: line|dash|marker|both|box); returns svg and the height used."""
    out, x, y, row_h = [], x0, y0, 16
    for name, color, style in entries:
        label = name if len(name) <= 48 else name[:47] + "…"
        w = 26 + 6.3 * len(label) + 14
        if x + w > x0 + width and x > x0:
            x, y = x0, y + row_h
        if style == "marker":
            sym = f'<circle cx="{_f(x + 9)}" cy="{_f(y - 4)}" r="3.5" fill="{color}"/>'
        elif style == "both":
            sym = (f'<path d="M{_f(x)} {_f(y - 4)}h18" stroke="{color}" stroke-width="2" stroke-dasharray="5 3" '
                   f'fill="none"/><circle cx="{_f(x + 9)}" cy="{_f(y - 4)}" r="3.5" fill="{color}"/>')
        elif style == "box":
            sym = f'<rect x="{_f(x + 2)}" y="{_f(y - 10)}" width="14" height="10" fill="{color}"/>'
        else:
            dash = ' stroke-dasharray="5 3"' if style == "dash" else ""
            sym = f'<path d="M{_f(x)} {_f(y - 4)}h18" stroke="{color}" stroke-width="2"{dash} fill="none"/>'
        out.append(f"<g>{sym}{_text(x + 24, y, label, size=11)}</g>")
        x += w
    return "".join(out), (y - y0) + row_h if entries else 0


def xy_chart(series: Sequence[Series], *, title: str, x_label: str, y_label: str, log_x: bool = True,
             log_y: bool = False, x_base: int = 10, y_base: int = 10, x_fmt: Callable[[float], str] = fmt_si,
             y_fmt: Callable[[float], str] = fmt_si, width: int = 580, height: int = 320, diagonal: bool = False,
             y_zero: bool = True, note: str = "", empty_message: str = "no data to draw") -> Markup:
    """Lines and/or markers on linear or log axes, with ticks, grid, axis labels and a legend.

    ``diagonal`` draws y = x across the shared range (predicted vs measured).
    """
    clean: list[Series] = []
    for i, s in enumerate(series):
        pts = [(float(x), float(y)) for x, y in s.points
               if math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x) and (y > 0 or not log_y)]
        if pts:
            clean.append(Series(s.name, pts, s.mode, s.color or PALETTE[i % len(PALETTE)], s.dashed, s.labels,
                                s.legend))
    if not clean:
        return _empty(width, 120, title, empty_message)
    xs = [x for s in clean for x, _ in s.points]
    ys = [y for s in clean for _, y in s.points]
    if diagonal:
        both = xs + ys
        xs, ys = both, both
    ax = make_axis(xs, log=log_x, base=x_base)
    ay = make_axis(ys, log=log_y, base=y_base, zero=y_zero and not log_y, max_ticks=6)
    if diagonal:
        ay = ax if log_x == log_y else ay

    entries = _entries(clean)
    if diagonal:
        entries.append(("y = x (perfect prediction)", "#9ca3af", "dash"))
    left, right, top = 64, 16, 30
    plot_w = width - left - right
    legend_svg, legend_h = _legend(entries, left, 0, plot_w)
    bottom = 44 + legend_h + (16 if note else 0)
    plot_h = max(120, height - top - bottom)
    total_h = top + plot_h + bottom

    def px(x: float) -> float:
        return left + ax.frac(x) * plot_w

    def py(y: float) -> float:
        return top + plot_h - ay.frac(y) * plot_h

    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {total_h}" width="{width}" '
           f'height="{total_h}" role="img" aria-label="{escape(title)}" {FONT}>',
           f'<rect x="0" y="0" width="{width}" height="{total_h}" fill="#ffffff"/>',
           _text(left, 18, title, size=13, fill="#111827", extra=' font-weight="600"')]
    # grid and ticks
    for t in ax.ticks:
        x = px(t)
        out.append(f'<path d="M{_f(x)} {top}V{_f(top + plot_h)}" stroke="#eef0f3" fill="none"/>')
        out.append(_text(x, top + plot_h + 15, x_fmt(t), anchor="middle", size=10, fill="#4b5563"))
    for t in ay.ticks:
        y = py(t)
        out.append(f'<path d="M{left} {_f(y)}H{_f(left + plot_w)}" stroke="#eef0f3" fill="none"/>')
        out.append(_text(left - 6, y + 3.5, y_fmt(t), anchor="end", size=10, fill="#4b5563"))
    out.append(f'<path d="M{left} {top}V{_f(top + plot_h)}H{_f(left + plot_w)}" stroke="#9ca3af" fill="none"/>')
    out.append(_text(left + plot_w / 2, top + plot_h + 32, x_label, anchor="middle", size=11))
    out.append(_text(14, top + plot_h / 2, y_label, anchor="middle", size=11,
                     extra=f' transform="rotate(-90 14 {_f(top + plot_h / 2)})"'))
    clip = f"clip{next(_ids)}"
    out.append(f'<clipPath id="{clip}"><rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}"/></clipPath>')
    out.append(f'<g clip-path="url(#{clip})">')
    if diagonal:
        lo, hi = max(ax.lo, ay.lo), min(ax.hi, ay.hi)
        out.append(f'<path d="M{_f(px(lo))} {_f(py(lo))}L{_f(px(hi))} {_f(py(hi))}" stroke="#9ca3af" '
                   f'stroke-dasharray="5 3" fill="none"><title>y = x</title></path>')
    for s in clean:
        if s.mode in ("line", "both") and len(s.points) > 1:
            pts = sorted(s.points)
            d = "M" + "L".join(f"{_f(px(x))} {_f(py(y))}" for x, y in pts)
            dash = ' stroke-dasharray="6 4"' if s.dashed else ""
            out.append(f'<path d="{d}" stroke="{s.color}" stroke-width="2" fill="none"{dash}>'
                       f"<title>{escape(s.name)}</title></path>")
        if s.mode in ("markers", "both") or len(s.points) == 1:
            for i, (x, y) in enumerate(s.points):
                tip = s.labels[i] if i < len(s.labels) else f"{s.name}: {x_fmt(x)}, {y_fmt(y)}"
                out.append(f'<circle cx="{_f(px(x))}" cy="{_f(py(y))}" r="3.5" fill="{s.color}" fill-opacity="0.8">'
                           f"<title>{escape(tip)}</title></circle>")
    out.append("</g>")
    ly = top + plot_h + 52
    out.append(f'<g transform="translate(0 {_f(ly)})">{legend_svg}</g>')
    if note:
        out.append(_text(left, total_h - 6, note, size=10, fill="#6b7280"))
    out.append("</svg>")
    return Markup("".join(out))


def _byte_unit(v: float) -> float:
    unit = 1.0
    while v >= unit * 1024 * 2 and unit < 1024**5:
        unit *= 1024
    return unit


# -- horizontal stacked bars ---------------------------------------------------------------------

def stacked_bars(rows: Sequence[tuple[str, Sequence[tuple[str, float]]]], *, title: str,
                 fmt: Callable[[float], str] = fmt_bytes, limit: float | None = None, limit_label: str = "capacity",
                 colors: dict[str, str] | None = None, width: int = 720, bar_h: int = 22,
                 empty_message: str = "nothing to draw") -> Markup:
    """One horizontal bar per row, made of named segments; an optional vertical limit line (capacity)."""
    clean = [(label, [(n, float(v)) for n, v in segs if math.isfinite(float(v)) and float(v) > 0])
             for label, segs in rows]
    if not clean or not any(segs for _, segs in clean):
        return _empty(width, 100, title, empty_message)
    names: list[str] = []
    for _, segs in clean:
        for n, _v in segs:
            if n not in names:
                names.append(n)
    colors = dict(colors or {})
    for i, n in enumerate(names):
        colors.setdefault(n, PALETTE[i % len(PALETTE)])
    totals = [sum(v for _, v in segs) for _, segs in clean]
    vmax = max(totals + ([limit] if limit and math.isfinite(limit) else []))
    unit = _byte_unit(vmax) if fmt is fmt_bytes else 1.0
    axis = make_axis([0.0, vmax], log=False, zero=True, max_ticks=6, unit=unit)
    label_w = min(180, 12 + 6.5 * max(len(label) for label, _ in clean))
    left, right, top = label_w + 8, 84, 30
    plot_w = width - left - right
    gap = 8
    plot_h = len(clean) * (bar_h + gap)
    entries = [(n, colors[n], "box") for n in names]
    if limit:
        entries.append((f"{limit_label} {fmt(limit)}", "#111827", "dash"))
    legend_svg, legend_h = _legend(entries, left, 0, plot_w)
    total_h = top + plot_h + 24 + 14 + legend_h

    def px(v: float) -> float:
        return left + axis.frac(v) * plot_w

    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {total_h}" width="{width}" '
           f'height="{total_h}" role="img" aria-label="{escape(title)}" {FONT}>',
           f'<rect x="0" y="0" width="{width}" height="{total_h}" fill="#ffffff"/>',
           _text(8, 18, title, size=13, fill="#111827", extra=' font-weight="600"')]
    for t in axis.ticks:
        x = px(t)
        out.append(f'<path d="M{_f(x)} {top - 4}V{_f(top + plot_h)}" stroke="#eef0f3" fill="none"/>')
        out.append(_text(x, top + plot_h + 14, fmt(t), anchor="middle", size=10, fill="#4b5563"))
    for i, (label, segs) in enumerate(clean):
        y = top + i * (bar_h + gap)
        shown = label if len(label) <= 28 else label[:27] + "…"
        out.append(_text(left - 6, y + bar_h / 2 + 4, shown, anchor="end", size=11))
        x = left
        for n, v in segs:
            w = px(v) - left
            out.append(f'<rect x="{_f(x)}" y="{y}" width="{_f(max(w, 0.5))}" height="{bar_h}" fill="{colors[n]}">'
                       f"<title>{escape(f'{label}: {n} {fmt(v)}')}</title></rect>")
            if w > 7.5 * len(fmt(v)) + 6:
                out.append(_text(x + w / 2, y + bar_h / 2 + 4, fmt(v), anchor="middle", size=10, fill="#ffffff"))
            x += w
        out.append(_text(x + 4, y + bar_h / 2 + 4, fmt(totals[i]), size=10, fill="#111827"))
    if limit:
        x = px(limit)
        out.append(f'<path d="M{_f(x)} {top - 6}V{_f(top + plot_h)}" stroke="#111827" stroke-width="1.5" '
                   f'stroke-dasharray="5 3" fill="none"><title>{escape(f"{limit_label} {fmt(limit)}")}</title></path>')
    out.append(f'<g transform="translate(0 {_f(top + plot_h + 38)})">{legend_svg}</g>')
    out.append("</svg>")
    return Markup("".join(out))


# -- pipeline timeline ---------------------------------------------------------------------------

TIMELINE_COLORS = {"F": ("#2563eb", "#93c5fd"), "B": ("#ea580c", "#fdba74"), "W": ("#16a34a", "#86efac")}
TIMELINE_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (W)"}


def timeline_chart(ranks: Sequence[Sequence[Box]], *, title: str, rank_labels: Iterable[str] | None = None,
                   split_backward: bool = False, width: int = 1180, row_h: int = 22) -> Markup:
    """One row per rank; a box per operation, colored by kind (alternate chunks lighter); gaps are bubble."""
    ranks = [list(r) for r in ranks]
    end = max((b.end_s for r in ranks for b in r), default=0.0)
    if not ranks or end <= 0:
        return _empty(width, 100, title, "no pipeline operations to draw")
    labels = list(rank_labels or [f"stage {i}" for i in range(len(ranks))])
    left, right, top = 70, 14, 30
    plot_w = width - left - right
    plot_h = len(ranks) * row_h
    kinds = sorted({b.kind for r in ranks for b in r}, key="FBW".index)
    entries = [(("input gradient (B)" if split_backward and k == "B" else TIMELINE_NAMES[k]),
                TIMELINE_COLORS[k][0], "box")
               for k in kinds]
    if any(b.chunk % 2 for r in ranks for b in r):
        entries.append(("lighter: odd model chunk", "#cbd5e1", "box"))
    entries.append(("gap: pipeline bubble", "#f3f4f6", "box"))
    legend_svg, legend_h = _legend(entries, left, 0, plot_w)
    total_h = top + plot_h + 40 + legend_h
    axis = make_axis([0.0, end], log=False, zero=True, max_ticks=9)
    scale = plot_w / end

    out = [f'<svg class="chart timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {total_h}" '
           f'width="{width}" height="{total_h}" role="img" aria-label="{escape(title)}" {FONT}>',
           f'<rect x="0" y="0" width="{width}" height="{total_h}" fill="#ffffff"/>',
           _text(8, 18, title, size=13, fill="#111827", extra=' font-weight="600"')]
    for i, r in enumerate(ranks):
        y = top + i * row_h
        out.append(f'<rect x="{left}" y="{y + 1}" width="{plot_w}" height="{row_h - 2}" fill="#f3f4f6"/>')
        out.append(_text(left - 6, y + row_h / 2 + 4, labels[i] if i < len(labels) else str(i), anchor="end", size=10))
        for b in r:
            x, w = left + b.start_s * scale, (b.end_s - b.start_s) * scale
            if w <= 0:
                continue
            color = TIMELINE_COLORS.get(b.kind, ("#6b7280", "#d1d5db"))[b.chunk % 2]
            tip = (f"{labels[i] if i < len(labels) else i}: {TIMELINE_NAMES.get(b.kind, b.kind)} of micro-batch "
                   f"{b.microbatch}" + (f" (chunk {b.chunk})" if b.chunk else "")
                   + f", {fmt_seconds(b.start_s)} to {fmt_seconds(b.end_s)}")
            out.append(f'<rect x="{_f(x)}" y="{y + 2}" width="{_f(max(w - 0.6, 0.4))}" height="{row_h - 4}" '
                       f'fill="{color}"><title>{escape(tip)}</title></rect>')
            if w >= 7 * len(str(b.microbatch)) + 4:
                fill = "#ffffff" if b.chunk % 2 == 0 else "#111827"
                out.append(_text(x + w / 2, y + row_h / 2 + 3.5, str(b.microbatch), anchor="middle", size=9, fill=fill))
    for t in axis.ticks:
        if t > end * 1.0001:
            continue
        x = left + t * scale
        out.append(f'<path d="M{_f(x)} {_f(top + plot_h)}v4" stroke="#6b7280" fill="none"/>')
        out.append(_text(x, top + plot_h + 16, fmt_seconds(t), anchor="middle", size=10, fill="#4b5563"))
    out.append(f'<g transform="translate(0 {_f(top + plot_h + 36)})">{legend_svg}</g>')
    out.append("</svg>")
    return Markup("".join(out))
