"""Per-row comparison of A/B benchmark CSVs (``benchmarks/ab_run.sh``): for each row, the
times of the "base" passes, those of the "new" passes, and base / new of their medians
(> 1: the new tree is faster). A row is identified by the columns before its time column
(``time_us``, ``us``, ``avg_ms`` or ``ms``: the first of these a CSV has), as every
benchmark here writes them.

    python benchmarks/ab_compare.py OUT_DIR NAME
"""

import csv
import glob
import os
import statistics
import sys

TIME_COLUMNS = ("time_us", "us", "avg_ms", "ms")


def load(path):
    """{row key: time} of one CSV (rows without a time skipped)."""
    with open(path) as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        time_col = next((c for c in TIME_COLUMNS if c in columns), None)
        if time_col is None:
            raise SystemExit(f"{path}: no time column (one of {TIME_COLUMNS})")
        key_cols = columns[:columns.index(time_col)]
        rows = {}
        for r in reader:
            try:
                rows[tuple(r[c] for c in key_cols)] = float(r[time_col])
            except (TypeError, ValueError):
                continue
        return rows


def compare(out_dir, name):
    runs = {side: [load(p) for p in sorted(glob.glob(os.path.join(out_dir, f"{name}_{side}_*.csv")))]
            for side in ("base", "new")}
    if not runs["base"] or not runs["new"]:
        raise SystemExit(f"no {name}_base_*.csv or {name}_new_*.csv in {out_dir}")
    lines = []
    for key in runs["base"][0]:
        base = [r[key] for r in runs["base"] if key in r]
        new = [r[key] for r in runs["new"] if key in r]
        if base and new:
            ratio = statistics.median(base) / statistics.median(new)
            lines.append(f"{' '.join(key):60s} base {'/'.join(f'{x:.4g}' for x in base):24s} "
                         f"new {'/'.join(f'{x:.4g}' for x in new):24s} base/new {ratio:.3f}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print("\n".join(compare(sys.argv[1], sys.argv[2])))
