"""Summarizes an Nsight Compute report (`ncu -o FILE --set full`): the warp-stall reasons of each
kernel (cycles per issued instruction, by reason) and the SASS instructions where the sampled warps
stalled most, with each one's leading reasons.

Runs on the GPU machine (it calls `ncu -i`): `python bench/ncu_hotspots.py REPORT.ncu-rep [--top N]`.
Not yet run on a real report (no device time since it was written): the metric and column names
it reads are from ncu's documentation, unverified against the device's ncu output.
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess


def ncu_csv(report: str, *args: str) -> list[dict]:
    out = subprocess.run(["ncu", "-i", report, "--csv", *args], check=True, capture_output=True,
                         text=True).stdout
    start = out.find('"')
    return list(csv.DictReader(io.StringIO(out[start:])))


def stall_reasons(report: str) -> None:
    rows = ncu_csv(report, "--page", "raw")
    for row in rows:
        if not str(row.get("ID", "")).strip().isdigit():  # the units row under the header
            continue
        name = row.get("Kernel Name", "?")[:90]
        stalls = {k: v for k, v in row.items()
                  if "average_warps_issue_stalled_" in k and k.endswith("_per_issue_active.ratio")}
        pairs = []
        for k, v in stalls.items():
            try:
                pairs.append((float(v.replace(",", "")), k.split("issue_stalled_")[1].split(
                    "_per_issue")[0]))
            except ValueError:
                continue
        pairs.sort(reverse=True)
        print(f"{name}: duration {row.get('gpu__time_duration.sum', '?')} ns")
        print("  stall cycles per issued instruction: " +
              ", ".join(f"{r} {c:.2f}" for c, r in pairs[:10] if c >= 0.05))


def hot_instructions(report: str, top: int) -> None:
    try:
        rows = ncu_csv(report, "--page", "source", "--print-source", "sass")
    except subprocess.CalledProcessError as e:
        print("  (no source page:", e.stderr.strip()[:200], ")")
        return
    rows = [r for r in rows if r.get("Address")]
    if not rows:
        return
    keys = list(rows[0])
    total_key = next((k for k in keys if k.startswith("Warp Stall Sampling (All")), None)
    reason_keys = [k for k in keys if k.startswith("stall_")
                   or ("Stall" in k and k != total_key and "Not-issued" not in k)]

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0

    if total_key is None:
        print("  columns:", keys[:40])
        return
    total = sum(num(r[total_key]) for r in rows) or 1.0
    rows.sort(key=lambda r: -num(r[total_key]))
    print(f"  top {top} SASS lines by stall samples ({int(total)} samples):")
    for r in rows[:top]:
        reasons = sorted(((num(r[k]), k) for k in reason_keys), reverse=True)[:3]
        why = ", ".join(f"{k.replace('stall_', '')} {v:.0f}" for v, k in reasons if v > 0)
        print(f"  {100 * num(r[total_key]) / total:5.1f}%  {r.get('Address', '')}  "
              f"{r.get('Source', '')[:70]:70s}  {why}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    for report in args.reports:
        print(f"== {report}")
        stall_reasons(report)
        hot_instructions(report, args.top)


if __name__ == "__main__":
    main()
