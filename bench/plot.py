"""The plot beside the results table: setup and agreement latency against N, both paths.

    python bench/plot.py                                   # bench/results/*.json -> docs/benchmarks.png
    python bench/plot.py --results DIR [DIR ...] --out docs/benchmarks.png

Reads every setup_latency-*.json and agree_latency-*.json found in the
given folders (the newest file of each name wins) and draws, per backend /
machine, p50 with a bar up to p90 (setup) or p99 (agreement), log scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

SETUP = [("peerd", "peerd (connected)", "tab:blue", "-"),
         ("seed warm", "seed, gloo group up", "tab:orange", "-"),
         ("peerd first use", "peerd, first use", "tab:blue", "--"),
         ("seed cold", "seed, gloo group made", "tab:orange", "--")]
AGREE = [("peerd", "tp_agree via peerd", "tab:blue", "-"), ("gloo", "all_reduce(MIN) via gloo", "tab:orange", "-")]


def load(folders: list[str]) -> dict[str, dict]:
    found: dict[str, tuple[float, dict]] = {}
    for folder in folders:
        for path in Path(folder).glob("*.json"):
            data = json.loads(path.read_text())
            if data.get("bench") not in ("setup_latency", "agree_latency"):
                continue
            key = f"{data['bench']}|{data['backend']}|{data['machine'].get('gpu') or data['machine'].get('cpu')}"
            mtime = path.stat().st_mtime
            if key not in found or found[key][0] < mtime:
                found[key] = (mtime, data)
    return {k: v for k, (_, v) in found.items()}


def label(data: dict) -> str:
    m = data["machine"]
    where = m.get("gpu") or f"{m.get('cores')} cores"
    return f"{data['backend']} backend, {where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", default=[str(C.RESULTS)])
    parser.add_argument("--out", default=str(C.ROOT / "docs" / "benchmarks.png"))
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(args.results)
    setups = sorted((v for k, v in runs.items() if k.startswith("setup_latency")), key=label)
    agrees = sorted((v for k, v in runs.items() if k.startswith("agree_latency")), key=label)
    cols = max(len(setups), len(agrees), 1)
    fig, axes = plt.subplots(2, cols, figsize=(5.2 * cols, 8.2), squeeze=False)

    def draw(ax, data, series, upper, title):
        ns = sorted(int(n) for n in data["by_n"])
        for key, name, color, style in series:
            rows = [data["by_n"][str(n)].get(key) for n in ns]
            if key in ("peerd", "gloo") and data["bench"] == "agree_latency":
                rows = [r["sync"] for r in rows]
            if any(r is None for r in rows):
                continue
            p50 = [r["p50"] * 1e3 for r in rows]
            hi = [r[upper] * 1e3 - r["p50"] * 1e3 for r in rows]
            ax.errorbar(ns, p50, yerr=[[0] * len(ns), hi], color=color, linestyle=style, marker="o",
                        capsize=3, label=f"{name} (p50, bar to {upper})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_yscale("log")
        ax.set_xlabel("ranks (N)")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)

    for i in range(cols):
        if i < len(setups):
            draw(axes[0][i], setups[i], SETUP, "p90", f"setup: common start to every rank ready\n{label(setups[i])}")
        else:
            axes[0][i].axis("off")
        if i < len(agrees):
            draw(axes[1][i], agrees[i], AGREE, "p99",
                 f"agreement: common start to every rank answered\n{label(agrees[i])}")
        else:
            axes[1][i].axis("off")
    fig.suptitle("peerd against the seeds' gloo handshake (lower is better)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out} ({len(setups)} setup run(s), {len(agrees)} agreement run(s))")


if __name__ == "__main__":
    main()
