"""Plots (matplotlib, imported only when a plot is drawn): seed 003's catalog heatmap (Fig. 3) and response-size
lines (Fig. 4), seed 002's format heatmap (Fig. 2), and the accuracy per arm with its intervals."""

from __future__ import annotations

import io
from typing import Any

from toolquake.proxy.escape import plot_text
from toolquake.proxy.replay.report.paper_tables import (
    FORMAT_HEATMAP_TITLE,
    NATIVE,
    PROMPTING,
    RESPONSE_PLOTS,
    budget_ticks,
    catalog_categories,
    catalog_heatmap_title,
    format_counts,
    format_grid,
    padding_counts,
    padding_grid,
)
from toolquake.proxy.replay.report.stats import ALPHA


def _cell_text(value: float, counts: tuple[int, int] | None) -> str:
    """A heatmap cell: the accuracy, and the valid / scored counts under it."""
    return f"{value:.2f}" + (f"\n{counts[0]}/{counts[1]}" if counts else "")


def heatmaps(summary: dict[str, Any]) -> dict[str, bytes]:
    """PNG heatmaps that the results support: {file name: PNG bytes}. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    # all subsets pooled (named for the subset when the arms scored one only), then one heatmap per subset, a
    # panel per model, as seed 003's Figs. 3, 6 and 7
    subsets = catalog_categories(summary)
    pooled = _catalog_heatmap(summary, plt, subsets[0] if len(subsets) == 1 else None)
    if pooled is not None:
        out["heatmap-catalog.png"] = pooled
        for category in subsets if len(subsets) > 1 else []:
            png = _catalog_heatmap(summary, plt, category)
            if png is not None:
                out[f"heatmap-catalog-{file_part(category)}.png"] = png
    labels, models, cells = format_grid(summary)
    if labels:
        counts = format_counts(summary)
        fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(models), 1.2 + 0.45 * len(labels)))
        grid = [[cells.get((c, m), float("nan")) for m in models] for c in labels]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(models)), [plot_text(m) for m in models], rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), [plot_text(c) for c in labels], fontsize=8)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, _cell_text(v, counts.get((labels[i], models[j]))), ha="center", va="center",
                            fontsize=6.5)
        fig.colorbar(im, ax=ax, label="AST accuracy")
        ax.set_title(FORMAT_HEATMAP_TITLE, fontsize=10)
        out["heatmap-formats.png"] = _png(fig, plt)
    return out


def file_part(text: str) -> str:
    """A category name as part of a file name: letters, digits, `_`, `-` and `.` kept, anything else `_`."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "_-.") else "_" for c in text)[:80].lstrip(".") or "_"


def _catalog_heatmap(summary: dict[str, Any], plt: Any, category: str | None) -> bytes | None:
    """Seed 003 challenge 1's heatmap, one panel per model: accuracy per (catalog size, position) of one subset
    (`category`) or of all pooled (None); None when no arm of it has a scored pair."""
    padded = [(m, mode, padding_grid(summary, m, category, mode)) for m in summary["models"]
              for mode in (NATIVE, PROMPTING)]
    padded = [(m, mode, g) for m, mode, g in padded if g[2]]
    if not padded:
        return None
    fig, axes = plt.subplots(1, len(padded), figsize=(4.2 * len(padded) + 1, 4), squeeze=False)
    for ax, (model, mode, (budgets, positions, cells)) in zip(axes[0], padded):
        counts = padding_counts(summary, model, category, mode)
        grid = [[cells.get((b, p), float("nan")) for b in budgets] for p in positions]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(budgets)), [t.replace(" (", "\n(") for t in budget_ticks(summary, model, budgets)],
                      fontsize=8)
        ax.set_yticks(range(len(positions)), [f"{p:g}" for p in positions])
        ax.set_xlabel("catalog size (tokens):\nbudget (≈ median reached)")
        ax.set_ylabel("position of the original tools")
        ax.set_title(plot_text(model if mode == NATIVE else f"{model} [{mode}]"), fontsize=9)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, _cell_text(v, counts.get((budgets[j], positions[i]))), ha="center", va="center",
                            fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), label="AST accuracy")
    fig.suptitle(plot_text(catalog_heatmap_title(category), 100), fontsize=10)
    return _png(fig, plt)


def response_plots(summary: dict[str, Any], fmt: str = "png") -> dict[str, bytes]:
    """Seed 003 Fig. 4 (challenge 2): accuracy with 95 % Wilson whiskers against the response size at the first
    position (a), and against the answer position at the largest size (b), one line per model; {name: bytes} of
    the plots the response_lengthening arms support."""
    exps = summary.get("response_experiments") or {}
    out: dict[str, bytes] = {}
    for name, key, xlabel, title in RESPONSE_PLOTS:
        lines = [(m, e[name]) for m, e in exps.items() if name in e]
        if not lines:
            continue
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if fmt == "svg":
            matplotlib.rcParams["svg.hashsalt"] = "toolquake"
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ticks: dict[float, str] = {}
        for i, (model, e) in enumerate(lines):
            pts = [pt for pt in e["points"] if pt["accuracy"] is not None]
            if name == "context_length":
                xs = [float(pt["budget_tokens"]) for pt in pts]
                ticks.update((x, pt["label"]) for x, pt in zip(xs, pts))
            else:
                xs = [float(int(pt["label"][1:])) for pt in pts]
                ticks.update((x, f"{pt['label']}\n({pt['position']:g})") for x, pt in zip(xs, pts))
            ys = [pt["accuracy"] for pt in pts]
            err = [[y - pt["accuracy_ci"][0] for y, pt in zip(ys, pts)], [pt["accuracy_ci"][1] - y for y, pt in
                                                                          zip(ys, pts)]]
            ax.errorbar([x + 0.015 * i * (max(xs) - min(xs) or 1) for x in xs], ys, yerr=err, marker="o", capsize=3,
                        label=plot_text(model))
        ax.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)], fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("AST accuracy (95 % Wilson)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        out[f"{key}.{fmt}"] = _png(fig, plt, fmt)
    return out


def _png(fig: Any, plt: Any, fmt: str = "png") -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110, bbox_inches="tight", metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
    return buf.getvalue()


def accuracy_plot(summary: dict[str, Any], fmt: str = "png") -> bytes | None:
    """Accuracy per arm with 95 % Wilson interval bars, one panel per model (None without scored arms)."""
    panels = [(m, [(p, a) for p, a in data["arms"].items() if a["n"]]) for m, data in summary["models"].items()]
    panels = [(m, arms) for m, arms in panels if arms]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if fmt == "svg":
        matplotlib.rcParams["svg.hashsalt"] = "toolquake"  # the same results give the same file
    width = max(len(arms) for _, arms in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(5.0, 1.0 + 0.55 * width), 3.2 * len(panels)),
                             squeeze=False)
    baseline = summary["baseline"]
    for ax, (model, arms) in zip(axes[:, 0], panels):
        xs = range(len(arms))
        accs = [a["accuracy"] for _, a in arms]
        lows = [a["accuracy"] - a["accuracy_ci"][0] for _, a in arms]
        highs = [a["accuracy_ci"][1] - a["accuracy"] for _, a in arms]
        colors = ["#555555" if p == baseline else
                  ("#c0392b" if (a.get("paired") or {}).get("significant") else "#2e86c1") for p, a in arms]
        for x, y, lo, hi, c in zip(xs, accs, lows, highs, colors):
            ax.errorbar([x], [y], yerr=[[lo], [hi]], fmt="o", color=c, capsize=4)
        base = next((a["accuracy"] for p, a in arms if p == baseline), None)
        if base is not None:
            ax.axhline(base, color="#555555", linestyle="--", linewidth=0.8)
        ax.set_xticks(list(xs), [plot_text(p) for p, _ in arms], rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_ylabel("AST accuracy")
        ax.set_title(f"{plot_text(model)}: accuracy per arm, 95 % Wilson intervals (red: paired drop vs "
                     f"{plot_text(baseline)} "
                     f"p < {ALPHA})", fontsize=9)
    return _png(fig, plt, fmt)


def survival_plots(summary: dict[str, Any], fmt: str = "png") -> dict[str, bytes]:
    """`toolquake sweep`: per axis, every run's survival curve (the share of cases still right at x) as a step line
    with its pointwise 95 % Wilson band, runs overlaid; the median breaking point dotted; a run's curve that is
    still above 0 at the maximum ends in an arrow (its censored cases). {"survival-<axis>.<fmt>": bytes}."""
    sweeps = summary.get("sweeps") or {}
    axes = list(dict.fromkeys(a for runs in sweeps.values() for a in runs))
    out: dict[str, bytes] = {}
    for axis in axes:
        runs = [(label, data[axis]) for label, data in sweeps.items() if axis in data and data[axis]["curve"]]
        if not runs:
            continue
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if fmt == "svg":
            matplotlib.rcParams["svg.hashsalt"] = "toolquake"
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, r in runs:
            xs = [p["x"] for p in r["curve"]] + [r["max"]]
            ys = [p["share"] for p in r["curve"]]
            lows = [p["ci"][0] for p in r["curve"]]
            highs = [p["ci"][1] for p in r["curve"]]
            line = ax.step(xs, ys + ys[-1:], where="post", label=plot_text(f"{label} (n={r['n']})"))[0]
            ax.fill_between(xs, lows + lows[-1:], highs + highs[-1:], step="post", alpha=0.18,
                            color=line.get_color(), linewidth=0)
            if r["median"] is not None:
                ax.axvline(r["median"], color=line.get_color(), linestyle=":", linewidth=1)
            if ys[-1] > 0:
                ax.annotate("", xy=(r["max"] * 1.02 + 0.5, ys[-1]), xytext=(r["max"], ys[-1]),
                            arrowprops={"arrowstyle": "->", "color": line.get_color()})
        first = runs[0][1]
        ax.set_xlabel(plot_text(f"{axis}: {first['unit']}"))
        ax.set_ylabel("share of cases still right")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(plot_text(f"Survival along {axis} (95 % Wilson bands; dotted: median breaking point)"),
                     fontsize=9)
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
        out[f"survival-{axis}.{fmt}"] = _png(fig, plt, fmt)
    return out
