"""Charts drawn on the server as inline SVG: stacked bars and lines over labelled buckets.

No script and nothing fetched: a chart is markup, with each bar or point carrying a `<title>`
the browser shows on hover. Values are laid out on a y axis from 0 in four round steps (1, 2 or
5 times a power of ten).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loramux.gateway.dashboard.html import Html, el

WIDTH, HEIGHT = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 10, 24
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
MAX_X_LABELS = 8
GRID_STEPS = 4


@dataclass(frozen=True)
class Series:
    name: str
    color: str
    """A CSS color (code, not data)."""
    values: Sequence[float | None]
    """One per label; None is no value (a gap in a line, nothing in a bar)."""


def compact(value: float) -> str:
    """1234 → 1.2k, 2500000 → 2.5M; small numbers as they are."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def axis_top(value: float, whole: bool) -> float:
    """The top of a y axis showing `value`: four grid steps of 1, 2 or 5 times a power of ten
    (whole numbers only when `whole`, for counts)."""
    if value <= 0:
        return 4.0
    step = value / GRID_STEPS
    power = 10 ** math.floor(math.log10(step))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= step)
    return GRID_STEPS * (max(step, 1) if whole else step)


def stacked_bars(labels: Sequence[str], series: Sequence[Series], title: str, unit: str) -> Html:
    """One bar per label, the series stacked bottom up in the order given."""
    totals = [sum(s.values[i] or 0 for s in series) for i in range(len(labels))]
    top = axis_top(max(totals, default=0), whole=True)
    slot = PLOT_W / max(len(labels), 1)
    bars = []
    for i, label in enumerate(labels):
        base, segments = 0.0, []
        for s in series:
            value = s.values[i] or 0
            if value > 0:
                segments.append(
                    _rect(LEFT + i * slot + slot * 0.15, base, value, slot * 0.7, top, s)
                )
            base += value
        tip = f"{label}: " + ", ".join(f"{s.name} {s.values[i] or 0:,.0f}" for s in series)
        bars.append(el("g", el("title", tip), segments, class_="bar"))
    return _figure(title, unit, labels, series, top, bars)


def lines(labels: Sequence[str], series: Sequence[Series], title: str, unit: str) -> Html:
    """One line per series through its values; a None breaks the line."""
    top = axis_top(max((v for s in series for v in s.values if v is not None), default=0), False)
    slot = PLOT_W / max(len(labels), 1)
    drawn = []
    for s in series:
        points = [
            (LEFT + (i + 0.5) * slot, _y(v, top), labels[i], v)
            for i, v in enumerate(s.values)
            if v is not None
        ]
        for run in _runs(points, s.values):
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in run)
            drawn.append(el("polyline", points=path, fill="none", stroke=s.color, stroke_width=2))
        drawn += [
            el(
                "circle",
                el("title", f"{label}: {s.name} {v:,.1f} {unit}"),
                cx=f"{x:.1f}",
                cy=f"{y:.1f}",
                r=3,
                fill=s.color,
            )
            for x, y, label, v in points
        ]
    return _figure(title, unit, labels, series, top, drawn)


def _runs(
    points: list[tuple[float, float, str, float]], values: Sequence[float | None]
) -> list[list[tuple[float, float, str, float]]]:
    """The points cut where a value is missing."""
    runs: list[list[tuple[float, float, str, float]]] = [[]]
    it = iter(points)
    for v in values:
        if v is None:
            runs.append([])
        else:
            runs[-1].append(next(it))
    return [r for r in runs if len(r) > 1]


def _y(value: float, top: float) -> float:
    return TOP + PLOT_H * (1 - value / top)


def _rect(x: float, base: float, value: float, width: float, top: float, s: Series) -> Html:
    y0, y1 = _y(base, top), _y(base + value, top)
    return el(
        "rect",
        x=f"{x:.1f}",
        y=f"{y1:.1f}",
        width=f"{width:.1f}",
        height=f"{max(y0 - y1, 0.5):.1f}",
        fill=s.color,
    )


def _figure(
    title: str,
    unit: str,
    labels: Sequence[str],
    series: Sequence[Series],
    top: float,
    marks: list[Html],
) -> Html:
    grid = []
    for k in range(GRID_STEPS + 1):
        value = top * k / GRID_STEPS
        y = _y(value, top)
        grid.append(
            el("line", x1=LEFT, x2=WIDTH - RIGHT, y1=f"{y:.1f}", y2=f"{y:.1f}", class_="grid")
        )
        grid.append(el("text", compact(value), x=LEFT - 6, y=f"{y + 4:.1f}", class_="ytick"))
    step = math.ceil(len(labels) / MAX_X_LABELS) or 1
    slot = PLOT_W / max(len(labels), 1)
    ticks = [
        el("text", label, x=f"{LEFT + (i + 0.5) * slot:.1f}", y=HEIGHT - 6, class_="xtick")
        for i, label in enumerate(labels)
        if i % step == 0
    ]
    svg = el(
        "svg",
        el("title", f"{title} ({unit})"),
        grid,
        marks,
        ticks,
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        role="img",
        aria_label=f"{title} ({unit})",
        class_="chart",
    )
    legend = [el("span", _swatch(s.color), s.name) for s in series]
    return el(
        "figure",
        el("figcaption", el("b", title), f" ({unit})", el("span", legend, class_="legend")),
        svg,
    )


def _swatch(color: str) -> Html:
    return el("svg", el("rect", width=10, height=10, fill=color), width=10, height=10)
