"""PNG plots of a run (matplotlib, imported here only).

``<prefix>bandwidth.png``: GB/s against tokens per rank, one panel per
(dispatch/combine, format), one line per backend and per baseline (all-to-all
and copy ceiling). ``<prefix>latency.png``: median time against tokens per
rank, one panel per (op, format); the fused ops' panels carry the
``grouped_gemm`` and (forward) ``weight_read`` rooflines. The prefix is ``<device>-ep<N>-``.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

from .model import OPS
from .results import BASELINES, Row

__all__ = ["write_plots"]

_STYLE = {"all_to_all": "--", "copy": ":", "grouped_gemm": "-.", "weight_read": (0, (5, 1, 1, 1, 1, 1))}


def _series(rows: Sequence[Row], op: str, fmt: str, value: str) -> Dict[str, List[Tuple[int, float]]]:
    out: Dict[str, List[Tuple[int, float]]] = {}
    for r in rows:
        if r.ok and r.op == op and r.format == fmt and getattr(r, value) is not None:
            out.setdefault(r.backend, []).append((r.tokens, float(getattr(r, value))))
    for v in out.values():
        v.sort()
    return out


def _colors(plt, rows: Sequence[Row]) -> Dict[str, object]:
    """One colour per backend or baseline, the same in every panel."""
    names = sorted({r.backend for r in rows}, key=lambda n: (n in BASELINES, n))
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def _grid(plt, rows: Sequence[Row], ops: List[str], formats: List[str], value: str, ylabel: str, title: str, path: str, logy: bool) -> None:
    from matplotlib.ticker import NullLocator

    colors = _colors(plt, rows)
    ticks = sorted({r.tokens for r in rows})
    fig, axes = plt.subplots(len(ops), len(formats), figsize=(5.5 * len(formats), 3.6 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, fmt in enumerate(formats):
            ax = axes[i][j]
            series = _series(rows, op, fmt, value)
            for name in sorted(series, key=lambda n: (n in BASELINES, n)):
                pts = series[name]
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                base = name in BASELINES
                ax.plot(xs, ys, linestyle=_STYLE.get(name, "-") if base else "-", color=colors[name],
                        marker="s" if base else "o", label=name + (" (baseline)" if base else ""))
            ax.set_title(f"{op}, {fmt}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            if logy:
                ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if series:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            missing = sorted({f"{r.backend}: {r.status}" for r in rows
                              if r.op == op and r.format == fmt and r.status != "ok" and r.backend not in series})
            if missing:
                ax.text(0.01, 0.01, "not measured: " + ", ".join(missing), fontsize=7, color="0.35",
                        transform=ax.transAxes, va="bottom")
    # fixed margins in inches (tight_layout costs seconds on log axes)
    height, width = 3.6 * len(ops), 5.5 * len(formats)
    fig.suptitle(title, y=1 - 0.2 / height)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.15 / width, bottom=0.6 / height, top=1 - 0.9 / height,
                        hspace=0.42, wspace=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(rows: Sequence[Row], settings: dict, plot_dir: str) -> List[str]:
    """Write the two PNG files; returns their paths. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    formats = list(settings["formats"])
    prefix = f"{settings['device']}-ep{settings['ep_size']}-"
    shape = (
        f"{settings['device']} EP {settings['ep_size']}: H={settings['hidden']} I={settings['intermediate']} "
        f"E={settings['experts']} top-{settings['topk']}"
    )
    paths = []
    comm = [op for op in ("dispatch", "combine") if op in settings["ops"]]
    if comm:
        path = os.path.join(plot_dir, prefix + "bandwidth.png")
        _grid(plt, rows, comm, formats, "gbps", "GB/s (token-row bytes per rank)", "MoeEp bandwidth, " + shape, path, True)
        paths.append(path)
    ops = [op for op in OPS if op in settings["ops"]]
    if ops:
        path = os.path.join(plot_dir, prefix + "latency.png")
        _grid(plt, rows, ops, formats, "median_ms", "median ms per call", "MoeEp latency, " + shape, path, True)
        paths.append(path)
    return paths
