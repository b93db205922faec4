"""Plot the num_splits sweep: bandwidth vs num_splits, one line per backend, peers as
horizontal lines, one panel per CSV (bench_decode_splits.py output).

    python benchmarks/plot_splits.py decode_splits.csv [more.csv ...] --out decode_splits.png
"""

import argparse
import csv
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csvs", nargs="+")
    p.add_argument("--out", default="decode_splits.png")
    args = p.parse_args()
    fig, axes = plt.subplots(1, len(args.csvs), figsize=(6 * len(args.csvs), 4.2), squeeze=False)
    for ax, path in zip(axes[0], args.csvs):
        rows = list(csv.DictReader(open(path)))
        if not rows:
            continue
        lines, peers = {}, {}
        for r in rows:
            bw = float(r["bw"]) if r["bw"] not in ("", "nan") else math.nan
            ns = int(r["num_splits"])
            if r["impl"] == "ours" and ns > 0:
                lines.setdefault(r["backend"].split()[0], []).append((ns, bw))
            elif r["impl"] == "ours" and ns == 0:
                peers[f"{r['backend']} (auto)"] = bw
            elif r["impl"] != "ours_launch":
                peers[r["impl"]] = bw
        for name, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"ours {name}")
        for i, (name, bw) in enumerate(sorted(peers.items())):
            if not math.isnan(bw):
                ax.axhline(bw, linestyle="--", color=f"C{(i + 3) % 10}", label=f"{name}: {bw:.2f}")
        r0 = rows[0]
        ax.set_title(f"{r0['benchmark_type']} B={r0['B']} K={r0['K']} H={r0['H']} "
                     f"Hkv={int(r0['H']) // int(r0['kvheads_per_group'])} D={r0['D']}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("num_splits")
        ax.set_ylabel("TB/s (K+V read once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
