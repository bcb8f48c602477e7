"""The time a role-partitioned launch could reach, from measured parts (CPU; no GPU needed).

  python tools/partition_bound.py --partition docs/results/2026-11-24-h100-sm-partition/sm_partition.json \
      --suffix-role docs/results/2026-11-24-h100-sm-partition/suffix_role*.json \
      --attention docs/results/2026-11-24-h100-cluster-merge/paper_b*/attention.json \
                  docs/results/2026-11-24-h100-overlap/llama_attention/*_attention.json

A role-partitioned launch runs the prefix product on ``132 - N`` SMs while ``N`` SMs do the
suffix attention, and merges the two parts afterwards. For each configuration of
``sm_partition.json`` (``tools/device/sm_partition.py``: the prefix kernel alone, ``T_p`` on
``C_p`` CTAs, and the TMA-only streaming bandwidth against the SMs streaming) this takes the
suffix role's measured throughput against its CTA count (``tools/device/suffix_role.py``: the
best variant at each count, for the configuration's KV heads and G, and its batch where
measured), and returns ``min over N of max(prefix on 132 - N SMs, suffix on N SMs)`` plus the
merge's floor (the two parts and their LSEs read, the output written, at the copy bandwidth).
The prefix on fewer SMs is taken as perfectly balanced (its SM-time conserved: a stream-K
schedule with free partial merges) -- optimistic. The suffix role's rate between measured CTA
counts is interpolated linearly, below the smallest at that count's rate per SM, above the
largest at the largest's, and never above the streaming bandwidth at the same count; at
another suffix length than measured, the same bytes per second.

Prints a Markdown table (and ``--out`` writes it with a JSON).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os


def curve(points: dict[int, float]):
  """Aggregate bytes/s at N SMs from measured ``{N: bytes/s}`` (see the module docstring)."""
  ns = sorted(points)

  def at(n: float) -> float:
    if n <= ns[0]:
      return points[ns[0]] * n / ns[0]
    if n >= ns[-1]:
      return points[ns[-1]]
    i = bisect.bisect_left(ns, n)
    lo, hi = ns[i - 1], ns[i]
    return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)

  return at


def role_points(paths: list[str]) -> dict[tuple, dict[int, float]]:
  """``{(hkv, g, batch): {N: best bytes/s}}`` from suffix_role JSONs (timings with ``us``)."""
  out: dict[tuple, dict[int, float]] = {}
  for path in paths:
    with open(path) as f:
      report = json.load(f)
    tag = os.path.basename(path)
    # The headline files carry no shape tag: B=1024, Hkv=1, G=8 (suffix_role.py's default).
    hkv, g, b = 1, 8, 1024
    if "_h" in tag:
      parts = tag.replace(".json", "").split("_")
      b = int(next(p[1:] for p in parts if p.startswith("b") and p[1:].isdigit()))
      hkv = int(next(p[1:] for p in parts if p.startswith("h") and p[1:].isdigit()))
      g = int(next(p[1:] for p in parts if p.startswith("g") and p[1:].isdigit()))
    pts = out.setdefault((hkv, g, b), {})
    for row in report["timings"]:
      if "us" in row:
        bw = row["mb"] * 1e6 / (row["us"] * 1e-6)
        pts[row["ctas"]] = max(pts.get(row["ctas"], 0.0), bw)
  return out


def ours_times(paths: list[str]) -> dict[tuple, float]:
  """``{(shape, B, P, S): ours µs}`` from attention benchmark JSONs."""
  out = {}
  for path in paths:
    with open(path) as f:
      rows = json.load(f)["rows"]
    for r in rows:
      shape = "paper" if (r["Hq"], r["Hkv"]) == (8, 1) else "llama-3-8b"
      if isinstance(r.get("ours_us"), float):
        out[(shape, r["B"], r["P"], r["S"])] = r["ours_us"]
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--partition", required=True)
  ap.add_argument("--suffix-role", nargs="+", required=True)
  ap.add_argument("--attention", nargs="*", default=[])
  ap.add_argument("--sms", type=int, default=None, help="default: the partition run's")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  with open(args.partition) as f:
    part = json.load(f)
  sms = args.sms or part["sms"]
  copy_bw = part["copy_bw"]
  stream = curve({int(n): v * 1e9 for n, v in part["best_gbps"].items()})
  roles = role_points(args.suffix_role)
  ours = ours_times(args.attention)
  rows = []
  for p in part["partition"]:
    shape, b, pp, s = p["config"].split(":")
    b, pp, s = int(b), int(pp), int(s)
    hkv, g = (1, 8) if shape == "paper" else (8, 4)
    fam = roles.get((hkv, g, b)) or next(
        (v for k, v in sorted(roles.items()) if k[:2] == (hkv, g)), None)
    if fam is None:
      raise ValueError(f"--suffix-role: no measurement for Hkv={hkv}, G={g} ({p['config']})")
    role = curve(fam)
    suffix_bytes = p["suffix_mb"] * 1e6
    t_p, c_p = p["prefix_us"], p["prefix_ctas"]
    work = t_p * min(c_p, sms)
    best = None
    for n in range(1, sms):
      t_pre = work / (sms - n) if c_p > sms - n else t_p
      t_suf = suffix_bytes / min(role(n), stream(n)) * 1e6
      cand = (max(t_pre, t_suf), n, t_pre, t_suf)
      best = cand if best is None or cand < best else best
    rows_q = b * hkv * g
    merge = (3 * rows_q * 128 * 2 + 2 * rows_q * 4) / copy_bw * 1e6
    bound = best[0] + merge
    now = ours.get((shape, b, pp, s))
    rows.append(dict(config=p["config"], floor_us=p["floor_us"], ours_us=now,
                     bound_us=bound, suffix_sms=best[1], prefix_us=best[2], suffix_us=best[3],
                     merge_us=merge, floor_over_bound=p["floor_us"] / bound,
                     floor_over_ours=p["floor_us"] / now if now else None))
  lines = ["| config | floor | ours (floor/ours) | bound: prefix / suffix on N SMs + merge | bound "
           "| floor / bound |", "|---|---:|---:|---|---:|---:|"]
  for r in rows:
    now = f"{r['ours_us']:.1f} ({r['floor_over_ours']:.2f})" if r["ours_us"] else ""
    lines.append(f"| {r['config']} | {r['floor_us']:.1f} | {now} | {r['prefix_us']:.1f} / "
                 f"{r['suffix_us']:.1f} on {r['suffix_sms']} + {r['merge_us']:.1f} | "
                 f"{r['bound_us']:.1f} | {r['floor_over_bound']:.2f} |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "partition_bound.json"), "w") as f:
      json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "partition_bound.md"), "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
