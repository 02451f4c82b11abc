"""Markdown tables of the benchmark results, for docs/benchmarks.md.

    python bench/report.py                      # every JSON in bench/results/
    python bench/report.py --results DIR

Prints one section per result file: where and when it ran, the command, and
the table with the ratios against the seed path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def where(d: dict) -> str:
    m = d["machine"]
    gpu = f", {m['gpu']} (driver {m.get('driver', '?')})" if m.get("gpu") else ""
    return (f"{m['date']}; {m['cores']} cores ({m['cpu']}){gpu}; Python {m['python']}, torch {m.get('torch', '-')}; "
            f"backend `{d['backend']}`; `{d['command']}`")


def ms(x: float) -> str:
    return C.ms(x)


def setup(d: dict) -> str:
    rows = []
    for n, p in sorted(d["by_n"].items(), key=lambda kv: int(kv[0])):
        pf, sc, pw, sw = (p[k] for k in ("peerd first use", "seed cold", "peerd", "seed warm"))
        rows.append([n, ms(pw["p50"]), ms(pw["p90"]), ms(sw["p50"]), ms(sw["p90"]),
                     f"**{C.ratio(pw['p50'], sw['p50'])}**", C.ratio(pw["p90"], sw["p90"]),
                     ms(pf["p50"]), ms(pf["p90"]), ms(sc["p50"]), ms(sc["p90"]),
                     f"**{C.ratio(pf['p50'], sc['p50'])}**", C.ratio(pf["p90"], sc["p90"])])
    out = C.markdown_table(["N", "peerd p50", "p90", "seed warm p50", "p90", "ratio p50", "ratio p90",
                            "peerd 1st use p50", "p90", "seed cold p50", "p90", "ratio p50", "ratio p90"], rows)
    n = max(d["by_n"], key=int)
    phases = []
    for path, r in d["by_n"][n].items():
        marks = ", ".join(f"{k} {ms(v)}" for k, v in r["phases_p50"].items())
        phases.append(f"- {path}: {marks}, ready {ms(r['p50'])}")
    return out + f"\n\nWhere the time goes at N={n} (ms from the common start, p50 of the slowest rank):\n\n" + "\n".join(phases)


def agree(d: dict) -> str:
    rows = []
    for n, r in sorted(d["by_n"].items(), key=lambda kv: int(kv[0])):
        p, g = r["peerd"], r["gloo"]
        rows.append([n, ms(p["sync"]["p50"]), ms(p["sync"]["p99"]), ms(g["sync"]["p50"]), ms(g["sync"]["p99"]),
                     f"**{C.ratio(p['sync']['p50'], g['sync']['p50'])}**",
                     f"**{C.ratio(p['sync']['p99'], g['sync']['p99'])}**",
                     ms(p["round_period"]), ms(g["round_period"]), C.ratio(p["round_period"], g["round_period"])])
    return C.markdown_table(["N", "peerd p50", "p99", "gloo p50", "p99", "ratio p50", "ratio p99",
                             "peerd back-to-back round", "gloo round", "ratio"], rows)


def failure(d: dict) -> str:
    fl = d["floor"]
    rows = [["-", "kernel floor: SIGKILL to pidfd readable (same kind of process)", ms(C.quantile(fl, 0.5)), "",
             ms(max(fl)), ""]]
    for moment in ("handshake", "agreement"):
        med = {}
        for path in ("peerd", "seed"):
            trials = d["rows"].get(f"{path}/{moment}", [])
            if not trials:
                continue
            med[path] = C.quantile([t["slowest"] for t in trials], 0.5)
            counts: dict = {}
            for t in trials:
                for o in t["outcomes"].values():
                    counts[o] = counts.get(o, 0) + 1
            how = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
            name = "peerd" if path == "peerd" else f"seed (gloo timeout {d['seed_timeout']:g} s)"
            rows.append([moment, name, ms(med[path]), ms(C.quantile([t["fastest"] for t in trials], 0.5)),
                         ms(max(t["slowest"] for t in trials)), how])
        if len(med) == 2:
            rows.append([moment, "ratio peerd / seed", f"**{med['peerd'] / med['seed']:.4f}**", "", "", ""])
    return C.markdown_table(["moment", "path", "every survivor (median)", "first survivor", "worst trial",
                             "what the survivors got"], rows) + f"\n\nN = {d['npes']}, rank {d['npes'] - 1} killed."


def throughput(d: dict) -> str:
    rows = []
    for g, r in sorted(d["by_groups"].items(), key=lambda kv: int(kv[0])):
        rows.append([g, f"{r['votes_peerd']:,.0f}", f"{r['votes_seed']:,.0f}", C.ratio(r["votes_peerd"], r["votes_seed"]),
                     f"{r['cycles_peerd']:,.0f}", f"{r['cycles_seed']:,.0f}", C.ratio(r["cycles_peerd"], r["cycles_seed"])])
    out = C.markdown_table(["concurrent groups", "votes/s peerd", "votes/s gloo", "ratio",
                            "join+commit+release/s peerd", "setup+free/s seed", "ratio"], rows)
    if "rss" in d:
        r = d["rss"]
        out += (f"\n\nDaemon RSS: {d['rss_start'] / C.MiB:.1f} MiB fresh; {r['before'] / C.MiB:.1f} MiB before and "
                f"{r['after'] / C.MiB:.1f} MiB after {r['cycles']:,} join+commit+release cycles over {r['groups']} "
                f"groups ({r['cycles_per_s']:,.0f} cycles/s); buffer sets left {r['groups_left']}, agreements left "
                f"{r['agreements_left']}.")
    return out


def footprint(d: dict) -> str:
    default = d["default context (cudaFree(0), cuda-bindings)"]
    rows = [["`peerd serve --backend cuda`, idle (NVML used-memory delta)", f"{d['daemon']['measured'] / C.MiB:.1f}",
             f"**{C.ratio(d['daemon']['measured'], default)}**"]]
    if d["daemon"].get("reported") is not None:
        rows.append(["the same, as `peerd status` reports it", f"{d['daemon']['reported'] / C.MiB:.1f}",
                     C.ratio(d["daemon"]["reported"], default)])
    for k, v in d.items():
        if "context" in k:
            rows.append([k, f"{v / C.MiB:.1f}", C.ratio(v, default)])
    return C.markdown_table(["holder of a context on GPU 0", "MiB", "ratio to the default context"], rows)


def status(d: dict) -> str:
    base = d["rows"]["raw hello"]["p50"]
    rows = []
    order = ["raw hello", "client hello", "client status", "tp_agree npes=1", "gloo all_reduce npes=1"]
    names = order + sorted(k for k in d["rows"] if k not in order)
    for name in names:
        s = d["rows"][name]
        sub = "subprocess" in name
        scale, unit = (1e3, "ms") if sub else (1e6, "us")
        rows.append([name, f"{s['p50'] * scale:.1f} {unit}", f"{s['p99'] * scale:.1f} {unit}", C.ratio(s["p50"], base)])
    return C.markdown_table(["call", "p50", "p99", "ratio to raw hello"], rows)


RENDER = {"setup_latency": setup, "agree_latency": agree, "failure_latency": failure, "throughput": throughput,
          "gpu_footprint": footprint, "status_latency": status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(C.RESULTS))
    args = parser.parse_args()
    for path in sorted(Path(args.results).glob("*.json")):
        d = json.loads(path.read_text())
        render = RENDER.get(d.get("bench"))
        if render is None:
            continue
        print(f"### {path.name}\n\n{where(d)}\n\n{render(d)}\n")


if __name__ == "__main__":
    main()
