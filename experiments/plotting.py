"""Drawing for the report: a figure is first a spec (plain data: panels of series with their
spread, reference lines, a caption), tested without drawing; `render` turns it into a
matplotlib Figure (object API, no pyplot state) and `save` writes it as a PNG at print
resolution plus, when asked, a vector copy (SVG or PDF).

Conventions, for every figure:
- a point is a median; its band (connected series) or error bar (markers only) is the
  interquartile range, the 25th to 75th percentile interpolated linearly as numpy's
  `percentile` does, of the samples it summarizes; a point of one sample has none, and the
  caption says how many samples a point has (`n_text`);
- series of one `group` share a colour and a marker across the figure's panels; a series'
  `style` sets its line: "solid" (filled markers), "dashed" (hollow markers, drawn on top,
  so a curve equal to a solid one still shows), "formula" (black dashes, no markers);
- one legend per figure, outside the axes; the caption under the axes;
- an axis whose positive data spans a factor LOG_RATIO or more is logarithmic; a log axis
  with zeros on it is symmetric-log (linear below the smallest positive decade), so a zero
  is drawn at 0, not at an invented floor.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

DPI = 200  # PNG: print resolution
PANEL_IN = (6.0, 4.2)  # inches per line panel (width, height)
LOG_RATIO = 8.0  # max / min at which an axis becomes logarithmic
FORMATS = ("png", "svg", "pdf")  # PNG is always written; svg or pdf besides it when asked
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")  # 11 against 10 colours: 110 distinct pairs
STYLE_LINES = {"solid": "-", "dashed": "--", "formula": (0, (5, 3))}


@dataclass(frozen=True)
class Point:
    """A median `y` at `x`, the interquartile range [lo, hi] of its `n` samples (None: n=1)."""

    x: float
    y: float
    lo: float | None = None
    hi: float | None = None
    n: int = 1


@dataclass(frozen=True)
class Series:
    """One curve: `group` names its colour, marker and legend entry (None: no group, e.g. a
    formula line, drawn in black); `style` one of STYLE_LINES; `connect` False draws
    markers only (points whose differences are noise, not a trend)."""

    group: str | None
    points: tuple[Point, ...]
    style: str = "solid"
    connect: bool = True


@dataclass(frozen=True)
class Panel:
    """Axes of line series; `hlines` (y, legend label) reference lines such as break-even;
    scales None: chosen from the data (LOG_RATIO); `dodge`: the series' markers at one x
    spread sideways by a few points so none hides another; `markers` False: lines only."""

    series: tuple[Series, ...]
    xlabel: str
    ylabel: str
    title: str
    hlines: tuple[tuple[float, str], ...] = ()
    xscale: str | None = None
    yscale: str | None = None
    dodge: bool = False
    markers: bool = True


@dataclass(frozen=True)
class Row:
    """One setup in a dot panel: its value, per-prompt `samples` (drawn small behind it), its
    own `threshold` (None: it has none), whether it passed, and a `note` written beside its
    dot (e.g. its difference to the panel's reference line)."""

    label: str
    value: float
    samples: tuple[float, ...] = ()
    threshold: float | None = None
    ok: bool = True
    note: str | None = None


@dataclass(frozen=True)
class RowPanel:
    """A horizontal dot plot, one row per setup (first on top); `xscale` "linear" or "log"
    (zeros make it symmetric-log, see `row_scale`); `vlines` (x, legend label) reference
    lines; `value_label` the legend entry of the dots where the rows are measurements, not
    judged against bars (None: "passed its bars" / "failed a bar")."""

    rows: tuple[Row, ...]
    xlabel: str
    title: str
    xscale: str = "linear"
    vlines: tuple[tuple[float, str], ...] = ()
    value_label: str | None = None


@dataclass(frozen=True)
class FigureSpec:
    """Panels side by side, the caption under them, and the legend text of each line style
    used other than by groups (e.g. {"dashed": "predicted"}; a style missing here gets no
    legend entry of its own)."""

    panels: tuple
    caption: str
    styles: tuple[tuple[str, str], ...] = ()


# -- statistics ----------------------------------------------------------------------------
def quartiles(values) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile), linear interpolation (numpy's default)."""
    import numpy as np

    q1, q2, q3 = np.percentile(np.asarray(values, dtype=float), [25, 50, 75])
    return float(q1), float(q2), float(q3)


def quartile_fields(key: str, values, median: bool = False) -> dict[str, float]:
    """A record's spread of its metric `key` over the samples that metric summarizes, as
    the figures read it: {key_p25, key_p75} (`quartiles`), and key_p50 with `median` (for a
    metric that is not itself their median, e.g. a ratio of sums: the figure draws the p50)."""
    q1, q2, q3 = quartiles(values)
    return {f"{key}_p25": q1, **({f"{key}_p50": q2} if median else {}), f"{key}_p75": q3}


def point(x: float, ys) -> Point:
    """The median of `ys` at `x` with its interquartile range (none for a single sample)."""
    ys = list(ys)
    if len(ys) == 1:
        return Point(float(x), float(ys[0]))
    q1, med, q3 = quartiles(ys)
    return Point(float(x), med, q1, q3, len(ys))


def pooled(atoms: list[tuple[list, list]], bins: int = 20) -> tuple[Point, ...]:
    """Points from `atoms`, each (xs, ys) a unit that is never split (one prompt's decode
    steps, the prompts of one length): sorted by median x and merged into at most `bins`
    runs of consecutive atoms of about equal count; per run the median of its pooled x and
    `point` of its pooled y."""
    import numpy as np

    atoms = sorted((a for a in atoms if len(a[1])), key=lambda a: float(np.median(a[0])))
    chunks = np.array_split(np.arange(len(atoms)), min(bins, len(atoms))) if atoms else []
    out = []
    for chunk in chunks:
        xs = [x for i in chunk for x in atoms[i][0]]
        out.append(point(float(np.median(xs)), [y for i in chunk for y in atoms[i][1]]))
    return tuple(out)


def n_text(series) -> str:
    """'n=K per point' or 'n=A-B per point' over the points of `series`."""
    ns = sorted({p.n for s in series for p in s.points})
    if not ns:
        return "no points"
    return f"n={ns[0]} per point" if len(ns) == 1 else f"n={ns[0]}-{ns[-1]} per point"


def merge_identical(series: list[Series], sep: str = " = ") -> list[Series]:
    """Series with equal points and style drawn once: one series whose group joins theirs
    with `sep` ("dense = paged"), in first-seen order; groupless series stay groupless."""
    merged: dict[tuple, list[Series]] = {}
    for s in series:
        merged.setdefault((s.points, s.style), []).append(s)
    out = []
    for same in merged.values():
        groups = [s.group for s in same if s.group is not None]
        out.append(Series(sep.join(groups) if groups else None, same[0].points, same[0].style, same[0].connect))
    return out


def axis_scale(values, forced: str | None = None) -> str:
    """`forced`, else "log" when every value is positive and max / min >= LOG_RATIO."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if forced or not vals:
        return forced or "linear"
    return "log" if min(vals) > 0 and max(vals) / min(vals) >= LOG_RATIO else "linear"


def row_scale(panel: RowPanel) -> tuple[str, float | None]:
    """A dot panel's x scale: "log" when it asks for one and has no zero; "symlog" with the
    largest power of 10 below its smallest positive value as linear threshold when it
    has zeros; else "linear". Second: the threshold (symlog) or None."""
    vals = [v for r in panel.rows for v in (r.value, *r.samples, r.threshold) if v is not None]
    if panel.xscale != "log" or not vals:
        return panel.xscale, None
    positive = [v for v in vals if v > 0]
    if min(vals) > 0:
        return "log", None
    return "symlog", 10.0 ** math.floor(math.log10(min(positive))) if positive else 1.0


# -- drawing -------------------------------------------------------------------------------
class _Look:
    """Colour and marker per group, first come first served, shared by a figure's panels;
    the legend's proxy of each group (solid line, filled marker)."""

    def __init__(self):
        self.groups: dict[str, tuple[str, str, bool, bool]] = {}  # group -> (colour, marker, line, markers)

    def of(self, s: Series, markers: bool = True) -> tuple[str, str]:
        if s.group is None:
            return "black", ""
        if s.group not in self.groups:
            i = len(self.groups)
            self.groups[s.group] = (f"C{i % 10}", MARKERS[i % len(MARKERS)], s.connect, markers)
        colour, marker, _, _ = self.groups[s.group]
        return colour, marker

    def handles(self) -> dict:
        from matplotlib.lines import Line2D

        return {g: Line2D([], [], color=c, marker=m if dots else "", linestyle="-" if line else "none", markersize=5)
                for g, (c, m, line, dots) in self.groups.items()}


def _line_kw(s: Series, colour: str, marker: str, markers: bool) -> dict:
    """plot() keywords of a series by its style (see the module's conventions)."""
    kw = {"color": colour, "linestyle": STYLE_LINES[s.style] if s.connect else "none", "linewidth": 1.2,
          "marker": marker if markers else "", "markersize": 6, "zorder": 3}
    if s.style == "dashed":
        kw.update(markerfacecolor="white", markersize=4.5, zorder=4)
    elif s.style == "formula":
        kw.update(color="black", marker="", linewidth=1.0, zorder=5)
    return kw


def _set_scale(ax, which: str, scale: str) -> None:
    """Set an axis' scale; a log axis gets ticks at 1, 2 and 5 per decade written plainly."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{which}scale")(scale)
    if scale == "log":
        axis = ax.xaxis if which == "x" else ax.yaxis
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def depths(series, close=lambda a, b: abs(a - b) <= 0.01 * max(abs(a), abs(b))) -> list[list[int]]:
    """Per series, per point (by x): how many earlier solid series have a point at the same
    x and a `close` y, i.e. how many markers it would hide (dashed series overlay by design:
    0, and they hide none)."""
    seen: dict[float, list[float]] = {}
    out = []
    for s in series:
        pts = sorted(s.points, key=lambda p: p.x)
        out.append([sum(close(p.y, y) for y in seen.get(p.x, []))
                    if s.style == "solid" else 0 for p in pts])
        for p in pts if s.style == "solid" else ():
            seen.setdefault(p.x, []).append(p.y)
    return out


def _draw_series(ax, s: Series, look: _Look, markers: bool, dx: float, depth: list[int]) -> None:
    """One series: its medians, and its IQR as a band (connected) or error bars (markers
    only) where its points have one; drawn `dx` points to the side (dodge) once the axes
    have taken its data limits; a point of `depth` d (it lies on d earlier series' points)
    gets a marker 1.8 points smaller per d, so those still show as rings around it."""
    import numpy as np
    from matplotlib.transforms import ScaledTranslation

    before = set(ax.get_children())
    pts = sorted(s.points, key=lambda p: p.x)
    x, y = np.array([p.x for p in pts]), np.array([p.y for p in pts])
    lo, hi = (np.array([np.nan if v is None else v for v in vals]) for vals in zip(*((p.lo, p.hi) for p in pts)))
    colour, marker = look.of(s, markers)
    kw = _line_kw(s, colour, marker, markers)
    ax.plot(x, y, **{**kw, "marker": ""})
    d = np.asarray(depth)
    for k in np.unique(d) if kw["marker"] else ():
        ax.plot(x[d == k], y[d == k], **{**kw, "linestyle": "none", "markersize": max(2.5, kw["markersize"] - 1.8 * k)})
    if not np.isnan(lo).all() and s.connect:
        ax.fill_between(x, lo, hi, color=colour, alpha=0.18, linewidth=0, zorder=2)
    elif not np.isnan(lo).all():
        ax.errorbar(x, y, yerr=[y - lo, hi - y], fmt="none", ecolor=colour, elinewidth=1.0, capsize=2.5, zorder=2)
    if dx:
        shift = ScaledTranslation(dx / 72, 0, ax.figure.dpi_scale_trans)
        for artist in set(ax.get_children()) - before:
            artist.set_transform(artist.get_transform() + shift)


def _draw_lines(ax, panel: Panel, look: _Look) -> dict:
    """A line panel; returns its reference lines' legend handles {label: artist}."""
    from matplotlib.ticker import NullLocator

    pts = [p for s in panel.series for p in s.points]
    ys = [v for p in pts for v in (p.y, p.lo, p.hi) if v is not None] + [y for y, _ in panel.hlines]
    xscale, yscale = axis_scale([p.x for p in pts], panel.xscale), axis_scale(ys, panel.yscale)
    k, f = len(panel.series), (math.log10 if yscale == "log" else float)
    span = (max(map(f, ys)) - min(map(f, ys))) if ys else 0.0
    layers = ([[0] * len(s.points) for s in panel.series] if panel.dodge else  # markers 2.5% of the span apart
              depths(panel.series, lambda a, b: abs(f(a) - f(b)) <= 0.025 * span))
    for i, (s, depth) in enumerate(zip(panel.series, layers)):
        _draw_series(ax, s, look, panel.markers, 4.0 * (i - (k - 1) / 2) if panel.dodge else 0.0, depth)
    handles = {label: ax.axhline(y, color="0.3", linestyle=":", linewidth=1.3, zorder=1) for y, label in panel.hlines}
    _set_scale(ax, "x", xscale)
    xs = sorted({p.x for p in pts})
    if len(xs) <= 8 and all(float(x).is_integer() for x in xs):  # few integer x (contexts, gammas): tick each
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
    _set_scale(ax, "y", yscale)
    ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel, title=panel.title)
    ax.grid(True, which="major", alpha=0.3)
    return handles


def _draw_rows(ax, panel: RowPanel, look: _Look) -> dict:
    """A dot panel, first row on top: per-prompt samples (small, grey), the setup's own
    threshold (a black bar), its value (blue dot passed, red cross failed) with its note
    beside it, the reference lines (dotted); returns the legend handles."""
    n, handles = len(panel.rows), {x_label: ax.axvline(x, color="0.3", linestyle=":", linewidth=1.3, zorder=1)
                                   for x, x_label in panel.vlines}
    for i, r in enumerate(panel.rows):
        y = n - 1 - i
        if r.samples:
            handles["each prompt"], = ax.plot(r.samples, [y] * len(r.samples), "o", color="0.55", markersize=3,
                                              zorder=2)
        if r.threshold is not None:
            handles["the setup's own threshold"], = ax.plot([r.threshold], [y], "|", color="black",
                                                            markersize=14, markeredgewidth=2, zorder=3)
        label, fmt, colour = ("passed its bars", "o", "C0") if r.ok else ("failed a bar", "X", "C3")
        key = (panel.value_label or label) if r.ok else label
        handles[key], = ax.plot([r.value], [y], fmt, color=colour, markersize=7, zorder=4)
        if r.note:
            ax.annotate(r.note, (r.value, y), xytext=(7, 4), textcoords="offset points", fontsize="small")
    ax.set_yticks(range(n), [r.label for r in reversed(panel.rows)])
    ax.set_ylim(-0.7, n - 0.3)
    scale, linthresh = row_scale(panel)
    if scale == "symlog":
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_xlim(left=0)
    else:
        ax.set_xscale(scale)
    if any(r.note for r in panel.rows):
        ax.margins(x=0.2)  # room for the notes right of the last dot
    ax.set(xlabel=panel.xlabel, title=panel.title)
    ax.grid(True, axis="x", alpha=0.3)
    return handles


def _style_handles(spec: FigureSpec) -> dict:
    """Legend entries of the line styles `spec.styles` names."""
    from matplotlib.lines import Line2D

    out = {}
    for style, text in spec.styles:
        kw = _line_kw(Series(None, (), style), "0.3", "o", True)
        out[text] = Line2D([], [], **{k: v for k, v in kw.items() if k != "zorder"})
    return out


def render(spec: FigureSpec):
    """The matplotlib Figure of `spec`: its panels side by side (dot panels share their
    rows), one legend outside them on the right, the caption under them (wrapped)."""
    from matplotlib.figure import Figure

    k, rows = len(spec.panels), isinstance(spec.panels[0], RowPanel)
    if rows:  # room for the row labels left of the first panel (about 0.08 inch a character)
        label_in = max(4.0, 1.5 + 0.08 * max(len(r.label) for r in spec.panels[0].rows))
        size = (3.4 * k + label_in, 0.3 * max(len(p.rows) for p in spec.panels) + 1.6)
    else:
        size = (PANEL_IN[0] * k + 2.6, PANEL_IN[1])
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(1, k, sharey=rows, squeeze=False)[0]
    look, handles = _Look(), {}
    for ax, panel in zip(axes, spec.panels):
        handles.update((_draw_rows if rows else _draw_lines)(ax, panel, look))
    handles = {**look.handles(), **_style_handles(spec), **handles}
    if handles:
        labels = [textwrap.fill(label, 40) for label in handles]  # a long label must not squeeze the axes away
        fig.legend(list(handles.values()), labels, loc="outside right upper", fontsize="small")
    caption = "\n".join(textwrap.fill(line, width=int(size[0] * 15)) for line in spec.caption.splitlines())
    fig.text(0.005, 0.0, caption, ha="left", va="top", fontsize="small", color="0.2")
    return fig


def save(fig, path: Path, formats=("png",)) -> dict[str, Path]:
    """`fig` as `path` with suffix .png (DPI, always) and each other format of `formats`
    (FORMATS; vector), the caption inside the saved area; {format: path written}."""
    meta = {"png": {"Software": None}, "svg": {"Date": None}, "pdf": {"CreationDate": None}}
    out = {}
    for fmt in dict.fromkeys(("png", *formats)):
        out[fmt] = Path(path).with_suffix(f".{fmt}")
        fig.savefig(out[fmt], dpi=DPI, bbox_inches="tight", pad_inches=0.1, metadata=meta[fmt])
    return out
