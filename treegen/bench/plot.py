"""The bench's PNG: acceptance length and speedup per method (bars grouped by category), and acceptance rate
per draft position (lines). matplotlib with the Agg backend: no display needed."""
from __future__ import annotations

from .metrics import Result, Summary, by_category

FIGSIZE = (17, 5)


class PlotError(RuntimeError):
    pass


def pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise PlotError("--plot needs matplotlib: pip install 'treegen[bench]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colors(results: list[Result]) -> dict[str, str]:
    """One colour per method in every panel."""
    return {r.label: f"C{i % 10}" for i, r in enumerate(results)}


def grouped_bars(ax, groups: dict[str, dict[str, Summary]], labels: list[str], color: dict[str, str], value,
                 error=None) -> None:
    """One group of bars per category, one bar per label."""
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(groups))]
        ys = [value(g[label]) for g in groups.values()]
        err = None if error is None else [list(e) for e in zip(*(error(g[label]) for g in groups.values()))]
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=label, color=color[label])
    ax.set_xticks(range(len(groups)), list(groups))


def acceptance_axes(ax, groups, results: list[Result]) -> None:
    labels = [r.label for r in results if r.overall.mean_accepted_length is not None]
    grouped_bars(ax, groups, labels, colors(results), lambda s: s.mean_accepted_length)
    ax.set_title("acceptance length (tokens per round)")


def speedup_axes(ax, groups, results: list[Result]) -> None:
    def error(s: Summary) -> tuple[float, float]:
        x = s.speedup_vs_ar
        return x.median - x.min, x.max - x.median

    grouped_bars(ax, groups, [r.label for r in results], colors(results), lambda s: s.speedup_vs_ar.median, error)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_title("speedup vs ar (median over repeats, min-max)")


def position_axes(ax, results: list[Result]) -> None:
    color, deepest = colors(results), 1
    for r in results:
        rates = r.overall.acceptance_per_position
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, color=color[r.label])
            deepest = max(deepest, len(rates))
    ax.set_xlim(0.5, deepest + 0.5)
    ax.set_xticks(range(1, deepest + 1, max(1, deepest // 16)))
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance rate per position (all prompts)")


def plot(results: list[Result], path: str, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE)
    groups = by_category(results)
    acceptance_axes(axes[0], groups, results)
    speedup_axes(axes[1], groups, results)
    position_axes(axes[2], results)
    handles, labels = axes[1].get_legend_handles_labels()  # the speedup panel has every method
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the legend under the panels
    fig.savefig(path, dpi=120)
    plt.close(fig)
