"""Draw the Grafana dashboard's panels with matplotlib from the same Prometheus queries, so the
docs can show what the dashboard looks like on real data without running Grafana.

Layout follows each panel's ``gridPos`` (24 columns); time series come from ``query_range``,
stat and bar-gauge panels from an instant query.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One Grafana grid unit (24 per row, ~30 px high) in inches.
COL_IN, ROW_IN = 0.75, 0.42

Series = list[tuple[dict[str, str], list[float], list[float]]]  # (labels, times, values)


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "NaN"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
    if unit == "ops":
        return f"{value:.2f}/s"
    return f"{value:.3g}"


def render(dashboard: dict[str, Any], instant: Callable[[str], list[dict[str, Any]]],
           series: Callable[[str], Series], out: Path, subtitle: str = "") -> None:
    """``instant(expr)`` → Prometheus vector result; ``series(expr)`` → lines for a range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(24 * COL_IN, bottom * ROW_IN + 0.8), facecolor="#111217")
    fig.suptitle(f"{dashboard['title']}  {subtitle}", color="white", x=0.01, ha="left",
                 fontsize=14)
    top_margin = 0.8 / (bottom * ROW_IN + 0.8)

    def box(g: dict[str, int]) -> tuple[float, float, float, float]:
        h_total = 1 - top_margin
        return (g["x"] / 24 + 0.004, 1 - top_margin - (g["y"] + g["h"]) / bottom * h_total + 0.012,
                g["w"] / 24 - 0.008, g["h"] / bottom * h_total - 0.03)

    for p in panels:
        g = p["gridPos"]
        if p["type"] == "row":
            fig.text(g["x"] / 24 + 0.004, 1 - top_margin - (g["y"] + 0.6) / bottom * (1 - top_margin),
                     p["title"], color="#ccccdc", fontsize=12, weight="bold")
            continue
        ax = fig.add_axes(box(g), facecolor="#181b1f")
        ax.set_title(p["title"], color="#ccccdc", fontsize=9, loc="left")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        if p["type"] == "timeseries":
            drawn, peak = 0, 0.0
            for t in p["targets"]:
                for labels, xs, ys in series(t["expr"]):
                    ys = [y if math.isfinite(y) else math.nan for y in ys]
                    ax.plot(xs, ys, linewidth=1.2, label=legend(t["legendFormat"], labels))
                    drawn += 1
                    # As Grafana: an infinite point (a ratio over an idle window) is not drawn.
                    peak = max([peak, *(y for y in ys if math.isfinite(y))])
            ax.set_ylim(0, peak * 1.3 if peak > 0 else 1)
            ax.tick_params(axis="x", labelsize=6)
            if drawn:
                ax.legend(fontsize=6, loc="upper left", facecolor="#181b1f", labelcolor="#ccccdc",
                          framealpha=0.6)
            else:
                ax.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", va="center",
                        transform=ax.transAxes)
                ax.set_xticks([])
        else:
            ax.set_xticks([])
            ax.set_yticks([])
            values = [(legend(t["legendFormat"], s["metric"]), float(s["value"][1]))
                      for t in p["targets"] for s in instant(t["expr"])]
            if not values:
                ax.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", va="center",
                        transform=ax.transAxes)
            elif p["type"] == "bargauge":
                names = [n for n, _ in values]
                ax.barh(names, [v for _, v in values],
                        color=["#f2495c" if v > 0 else "#73bf69" for _, v in values])
                ax.tick_params(axis="y", labelsize=6)
                ax.set_yticks(range(len(names)), names)
            else:
                text = "   ".join(f"{_fmt(v, unit)}" + (f" {n}" if len(values) > 1 else "")
                                  for n, v in values[:3])
                ax.text(0.5, 0.45, text, color="#73bf69", ha="center", va="center",
                        fontsize=16 if len(values) == 1 else 9, transform=ax.transAxes)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72, facecolor=fig.get_facecolor())
    plt.close(fig)
