"""The `flashgen bench` plot: TFLOP/s against sequence length, one panel per problem family.

It reads the CSV's records, not the in-memory rows, so a CSV brought back from a GPU machine
without matplotlib can be plotted elsewhere: `python -m flashgen.bench.plot bench.csv out.png`.
matplotlib is optional (the `bench` extra); callers check `available()` first.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from flashgen.bench.competitors import FLASHGEN

#: Panels per row of the figure.
COLUMNS = 4


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _family(rec: dict[str, str]) -> tuple[str, ...]:
    """Everything but the length (and the batch, which 16k tokens per batch ties to it)."""
    return (rec["mode"], rec["heads_q"], rec["heads_kv"], rec["head_dim"], rec["dtype"],
            rec["causal"])


def _title(family: tuple[str, ...]) -> str:
    mode, hq, hkv, d, dtype, causal = family
    heads = f"H{hq}" if hq == hkv else f"H{hq}/{hkv}"
    mode = {"both": "fwd+bwd"}.get(mode, mode)
    return f"{mode} {heads} D{d} {dtype}{' causal' if causal == 'true' else ''}"


def series(records: Iterable[dict[str, str]]) -> dict[tuple[str, ...],
                                                      dict[str, list[tuple[int, float]]]]:
    """family -> competitor -> sorted (Nq, TFLOP/s) points of correct runs only; families
    by mode (fwd, bwd, both), else in order of appearance."""
    out: dict[tuple[str, ...], dict[str, list[tuple[int, float]]]] = {}
    for rec in records:
        if rec["status"] != "ok" or not rec["tflops"]:
            continue
        points = out.setdefault(_family(rec), {}).setdefault(rec["competitor"], [])
        points.append((int(rec["seq_q"]), float(rec["tflops"])))
    for lines in out.values():
        for points in lines.values():
            points.sort()
    order = {"fwd": 0, "bwd": 1, "both": 2}
    return dict(sorted(out.items(), key=lambda item: order.get(item[0][0], 3)))


def plot(records: Sequence[dict[str, str]], path: Path, title: str = "") -> None:
    """Write the PNG; needs matplotlib (see `available`)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on GPU machines or CI
    import matplotlib.pyplot as plt

    panels = series(records)
    if not panels:
        raise ValueError("no correct timings to plot")
    # One colour per competitor in every panel (a panel may lack one, e.g. a GQA refusal).
    names = sorted(dict.fromkeys(n for lines in panels.values() for n in lines),
                   key=lambda n: n != FLASHGEN)
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
    cols = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False,
                             layout="constrained")
    for ax, (family, lines) in zip(axes.flat, panels.items(), strict=False):
        for name, points in sorted(lines.items(), key=lambda kv: names.index(kv[0])):
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=name, color=colours[name],
                    linewidth=2.5 if name == FLASHGEN else 1.2)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for points in lines.values() for x, _ in points})
        ax.set_xticks(ticks, [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks])
        ax.set_title(_title(family), fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m flashgen.bench.plot BENCH.csv OUT.png", file=sys.stderr)
        return 2
    if not available():
        print("matplotlib is not installed (pip install 'flashgen[bench]')", file=sys.stderr)
        return 1
    with Path(argv[0]).open(newline="") as f:
        records = list(csv.DictReader(f))
    device = records[0].get("device", "") if records else ""
    plot(records, Path(argv[1]), title=f"flashgen bench ({device})" if device else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
