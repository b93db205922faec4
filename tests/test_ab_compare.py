"""``benchmarks/ab_compare.py``: rows keyed by the columns before the time column, base / new
of the medians of each side's passes (CPU only)."""

import csv
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("ab_compare", os.path.join(ROOT, "benchmarks", "ab_compare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["impl", "batch", "time_us", "tbps"])
        w.writerows(rows)


def test_ratio_of_medians_per_row(tmp_path):
    ab = _module()
    _write(tmp_path / "x_base_1.csv", [["sm90", 64, 60.0, 1.4], ["sm90 fp8", 64, 50.0, 0.9]])
    _write(tmp_path / "x_base_2.csv", [["sm90", 64, 62.0, 1.4], ["sm90 fp8", 64, ""]])
    _write(tmp_path / "x_base_3.csv", [["sm90", 64, 61.0, 1.4]])
    _write(tmp_path / "x_new_1.csv", [["sm90", 64, 55.0, 1.5], ["sm90 fp8", 64, 40.0, 1.1]])
    lines = ab.compare(str(tmp_path), "x")
    assert len(lines) == 2
    assert lines[0].startswith("sm90 64") and lines[0].endswith(f"base/new {61.0 / 55.0:.3f}")
    assert lines[1].startswith("sm90 fp8 64") and lines[1].endswith(f"base/new {50.0 / 40.0:.3f}")
    with pytest.raises(SystemExit):
        ab.compare(str(tmp_path), "y")
