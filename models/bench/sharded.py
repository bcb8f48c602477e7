"""``hydragen bench sharded``: decoding on device meshes and across jax.distributed processes.

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false hydragen bench sharded --out runs/sharded
    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python -m models.bench.sharded --out ...

On one host with N devices it runs, each part in its own Python process so that
every part finds the devices free:

1. **Processes** (``--processes P``, default N): P processes x N/P devices under
   ``jax.distributed`` on localhost (each process sees only its own GPUs through
   ``CUDA_VISIBLE_DEVICES``; on CPUs its own host-platform devices): greedy tokens of a
   float32 model (hydragen with one prompt, with a two-level tree, standard) on the
   meshes ``(N, 1)`` and ``(1, N)``, and decode throughput on ``(N, 1)``.
2. **One process**, all N devices: the same tokens on ``(N, 1)``, ``(1, N)``,
   ``(N/2, 2)`` and with no mesh on one device; decode throughput of a bf16 random model
   (default Llama-3-8B shape, prompt 2048, hydragen, decode only: prefill and compilation
   excluded) on one device with no mesh at ``--batch`` sequences, and on each mesh
   ``(d, m)`` at ``d x --batch`` (every data shard holds as many sequences as the one
   device) and at the largest batch that fits (estimated from the device memory, halved
   on an out-of-memory error); the model-axis collectives of the compiled decode step
   (from the HLO: op, shape, bytes, per layer) and the time of one such all-reduce.
   Optional rows that would start within 45 s of ``--budget-s`` are skipped and listed.

The weights are drawn on the devices, each parameter straight into its shards
(``jax.jit`` with ``out_shardings``): no device ever holds the whole model. Writes
``sharded.json`` (after every part) and ``sharded.md`` under ``--out``. The processes
and the single process must give the same tokens, and the processes' throughput on
``(N, 1)`` must lie within 5% of the single process's (the Markdown says whether).
A CPU run of the logic at a tiny size::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m models.bench.sharded --model tiny --batch 8 --prefix 32 --new-tokens 6 \\
        --processes 2 --out /tmp/sharded
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import Optional

from models.bench import common

HERE = "models.bench.sharded"
OPTIONS = (  # (flag, argparse keywords): shared by the command and its worker processes
    ("--model", dict(default="llama-3-8b", help="preset shape for the throughput part")),
    ("--dtype", dict(default="bfloat16")),
    ("--batch", dict(type=int, default=512, help="sequences per data shard (default 512)")),
    ("--prefix", dict(type=int, default=2048, help="shared prompt tokens (default 2048)")),
    ("--new-tokens", dict(type=int, default=64)),
    ("--impl", dict(default="auto", help="attention implementation")),
    ("--token-impl", dict(default="auto", help="attention implementation of the token check")),
    ("--token-cases", dict(default="one,tree,standard",
                           help="cases of the token check: one (hydragen, one prompt), tree "
                           "(hydragen, two-level tree), standard")),
    ("--token-meshes", dict(default="all", choices=("all", "data"),
                            help="meshes of the token check: all, or only (N, 1) (and no mesh)")),
    ("--quick", dict(action="store_true", help="no largest-batch rows, no (N/2, 2) mesh")),
)


HELP = ("Sharded decoding: meshes of one process, jax.distributed processes, the same tokens, "
        "throughput, model-axis collectives.")


def configure(p: argparse.ArgumentParser) -> None:
  for flag, kw in OPTIONS:
    p.add_argument(flag, **kw)
  p.add_argument("--processes", type=int, default=None,
                 help="processes of the jax.distributed part (default: one per device; 1 or 0: "
                 "skip it)")
  p.add_argument("--budget-s", type=float, default=420,
                 help="wall-time budget: optional parts (collectives, then largest batches) that "
                 "would start within 45 s of it are skipped and listed (default 420)")
  p.add_argument("--out", default="runs/sharded")
  p.set_defaults(handler=_run)


# -- the parent: launches the parts, compares, writes ------------------------------------------

def _run(args: argparse.Namespace) -> int:
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  n, backend, kind = _probe()
  procs = n if args.processes is None else args.processes
  if procs > 1 and n % procs:
    raise SystemExit(f"hydragen bench sharded: {n} devices do not split over --processes "
                     f"{procs}; give a divisor of {n}")
  deadline = time.time() + args.budget_s
  forward = [x for flag, _ in OPTIONS for x in _forward(args, flag)] + ["--deadline", str(deadline)]
  result = dict(info=dict(devices=n, device=kind, backend=backend, date=time.strftime("%Y-%m-%d"),
                          **{f.lstrip("-").replace("-", "_"): getattr(
                              args, f.lstrip("-").replace("-", "_")) for f, _ in OPTIONS}))
  if procs > 1:
    port, k = _free_port(), n // procs
    outs = [os.path.join(args.out, f"process{i}.json") for i in range(procs)]
    error = _launch([[*forward, "--role", "process", "--coordinator", f"localhost:{port}",
                      "--num-processes", str(procs), "--process-id", str(i), "--json", outs[i]]
                     for i in range(procs)], [_device_env(i, k) for i in range(procs)],
                    timeout_s=max(240.0, 0.45 * args.budget_s))
    if error:  # reported; the single-process part still runs
      result["processes_error"] = error
      print(error, file=sys.stderr)
    else:
      parts = [json.load(open(o)) for o in outs]
      result["processes"] = dict(parts[0], count=procs, devices_each=k,
                                 same_tokens_on_every_process=all(
                                     p["tokens"] == parts[0]["tokens"] for p in parts))
  single = os.path.join(args.out, "single.json")
  error = _launch([[*forward, "--role", "single", "--json", single]], [{}],
                  timeout_s=max(240.0, deadline - time.time() + 120))
  if error:
    raise SystemExit(error)
  result["single"] = json.load(open(single))
  result["comparison"] = _compare(result)
  result["info"]["wall_s"] = time.perf_counter() - t0
  with open(os.path.join(args.out, "sharded.json"), "w") as f:
    json.dump(result, f, indent=1)
  md = markdown(result)
  common.write_text(os.path.join(args.out, "sharded.md"), md)
  print(md)
  bad = [c for c in result["comparison"] if c.get("same_tokens") is False]
  return 1 if (bad or "processes_error" in result
               or result.get("processes", {}).get("same_tokens_on_every_process") is False) else 0


def _forward(args, flag):
  value = getattr(args, flag.lstrip("-").replace("-", "_"))
  if isinstance(value, bool):
    return [flag] if value else []
  return [flag, str(value)]


def _probe():
  """(device count, backend, device kind), asked of a short-lived process (the GPUs stay free)."""
  code = ("import jax, json; print(json.dumps([jax.device_count(), jax.default_backend(), "
          "jax.devices()[0].device_kind]))")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=300).stdout
  return tuple(json.loads(out.strip().splitlines()[-1]))


def _device_env(i: int, k: int) -> dict:
  """Process i's devices: GPUs [i k, (i+1) k) of the visible ones; k host-platform CPU devices."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  ids = visible.split(",") if visible else [str(j) for j in range(1024)]
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  return dict(CUDA_VISIBLE_DEVICES=",".join(ids[i * k:(i + 1) * k]),
              XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={k}".strip())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(argvs, envs, timeout_s: float = 3600) -> Optional[str]:
  """Runs one worker per argv at once; kills them all (process groups) if one fails or hangs.

  Returns None, or what went wrong.
  """
  procs = []
  try:
    for argv, env in zip(argvs, envs):
      procs.append(subprocess.Popen([sys.executable, "-m", HERE, *argv], start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1", **env)))
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
      if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
        return (f"hydragen bench sharded: a worker failed or hung past {timeout_s:.0f} s "
                f"(exit codes {[p.returncode for p in procs]})")
      time.sleep(0.5)
    if any(p.returncode for p in procs):
      return f"hydragen bench sharded: worker exit codes {[p.returncode for p in procs]}"
    return None
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()


def _compare(result) -> list[dict]:
  """Tokens of every layout against no mesh; the processes against the single process."""
  single = result["single"]
  rows = []
  ref = {k.split(" @ ")[0]: v for k, v in single["tokens"].items() if k.endswith("@ none")}
  for layout, part in [("1 process", single)] + [
      (f"{result['processes']['count']} processes", result["processes"])] * ("processes" in result):
    for key, tokens in part["tokens"].items():
      case, mesh = key.split(" @ ")
      if mesh != "none":
        rows.append(dict(layout=layout, mesh=mesh, case=case, same_tokens=tokens == ref[case]))
  if "processes_error" in result:
    lines += [f"jax.distributed part: {result['processes_error']}.", ""]
  if "processes" in result:
    p = result["processes"]["throughput"][0]
    s = next((r for r in single["throughput"] if r["mesh"] == p["mesh"] and r["batch"] == p["batch"]),
             None)
    if s and isinstance(s.get("tokens_per_s"), float) and isinstance(p.get("tokens_per_s"), float):
      ratio = p["tokens_per_s"] / s["tokens_per_s"]
      rows.append(dict(layout="throughput", mesh=str(tuple(p["mesh"])), batch=p["batch"],
                       ratio=ratio, within_5_percent=abs(ratio - 1) <= 0.05))
  return rows


# -- the workers ------------------------------------------------------------------------------

def main(argv=None) -> int:
  """``python -m models.bench.sharded [options]``: the command; with ``--role``: a worker."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--role" not in argv:
    p = argparse.ArgumentParser(prog="python -m models.bench.sharded",
                                description=__doc__.split("\n\n")[0])
    _configure(p)
    return _run(p.parse_args(argv))
  p = argparse.ArgumentParser(description="a worker of hydragen bench sharded")
  for flag, kw in OPTIONS:
    p.add_argument(flag, **kw)
  p.add_argument("--role", choices=("single", "process"), required=True)
  p.add_argument("--coordinator")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  p.add_argument("--json", required=True)
  p.add_argument("--deadline", type=float, default=float("inf"), help="epoch seconds")
  args = p.parse_args(argv)
  from models.bench.sharded_parts import collectives, label, throughput, token_cases
  from models.parallel import distributed
  if args.role == "process":
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  import jax

  n, t0 = jax.device_count(), time.perf_counter()
  say = (lambda *a: print(f"[{time.perf_counter() - t0:6.1f} s]", *a, flush=True)) if (
      jax.process_index() == 0) else (lambda *a: None)
  say(f"{args.role}: {jax.process_count()} process(es), {n} x {jax.devices()[0].device_kind}, "
      f"jax {jax.__version__}")
  out = dict(jax=jax.__version__, tokens={}, throughput=[], collectives=[], skipped=[])

  def save():
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)

  if args.role == "process":
    meshes = list(dict.fromkeys([(n, 1), (1, n)]))
    checked = meshes if args.token_meshes == "all" else meshes[:1]
    out["tokens"] = token_cases(checked, args.token_impl, say, args.token_cases.split(","))
    save()
    out["throughput"].append(throughput(_big_config(args), (n, 1), n * args.batch, args, say))
  else:
    meshes = list(dict.fromkeys([(n, 1), (1, n)] + [(n // 2, 2)] * (
        n >= 4 and n % 2 == 0 and not args.quick)))
    checked = meshes if args.token_meshes == "all" else meshes[:1]
    out["tokens"] = token_cases([None] + checked, args.token_impl, say,
                                args.token_cases.split(","))
    save()
    config = _big_config(args)
    out["throughput"].append(throughput(config, None, args.batch, args, say))
    for mesh in meshes:
      out["throughput"].append(throughput(config, mesh, mesh[0] * args.batch, args, say))
      save()
    def in_time(what: str) -> bool:
      if time.time() + 45 < args.deadline:
        return True
      out["skipped"].append(what)
      return False

    for mesh in meshes:  # the model axis's collectives first: they explain its efficiency
      if mesh[1] > 1 and in_time(f"collectives {label(mesh)}"):
        out["collectives"].append(collectives(config, mesh, mesh[0] * args.batch, args, say))
        save()
    for mesh in ([] if args.quick else [None] + meshes):
      if in_time(f"largest batch {label(mesh)}"):
        out["throughput"].append(throughput(config, mesh, None, args, say))
        save()
  save()
  say("done")
  return 0


def _big_config(args):
  from models.model.config import preset

  config = preset(args.model)
  longest = args.prefix + args.new_tokens + 1
  return config.replace(dtype=args.dtype,
                        max_position_embeddings=max(config.max_position_embeddings, longest))


# -- the report -------------------------------------------------------------------------------

def markdown(result) -> str:
  info, single = result["info"], result["single"]
  fmt = lambda v, f: (f % v) if isinstance(v, float) else ("" if v is None else str(v))
  lines = [f"{info['devices']} x {info['device']}, jax {single['jax']}, {info['date']}, "
           f"impl={info['impl']}; wall {info['wall_s']:.0f} s", ""]
  if "processes_error" in result:
    lines += [f"jax.distributed part: {result['processes_error']}.", ""]
  if "processes" in result:
    p = result["processes"]
    lines += [f"jax.distributed: {p['count']} processes x {p['devices_each']} device(s) on one "
              f"host; every process returned all the rows: "
              f"{'yes' if p['same_tokens_on_every_process'] else 'NO'}.", ""]
  lines += ["| layout | mesh | case | same tokens as 1 device, no mesh |", "|---|---|---|---|"]
  lines += [f"| {c['layout']} | {c['mesh']} | {c['case']} | {'yes' if c['same_tokens'] else 'NO'} |"
            for c in result["comparison"] if "case" in c]
  for c in result["comparison"]:
    if "ratio" in c:
      lines += ["", f"Throughput on {c['mesh']} at batch {c['batch']}: processes / one process = "
                f"{c['ratio']:.3f} ({'within' if c['within_5_percent'] else 'NOT within'} 5%)."]
  lines += ["", f"{info['model']} {info['dtype']} (random weights), hydragen, prompt "
            f"{info['prefix']} tokens, {info['new_tokens']} new, decode only. Efficiency = "
            "tokens/s / (devices x tokens/s of 1 device at --batch).", "",
            "| layout | mesh (data, model) | devices | batch | tokens/s | ms / step | "
            "efficiency | weights drawn s | compile s |", "|---|---|---|---|---|---|---|---|---|"]
  base = single["throughput"][0].get("tokens_per_s")
  rows = [("1 process", r) for r in single["throughput"]] + [
      (f"{result['processes']['count']} processes", r)
      for r in result.get("processes", {}).get("throughput", [])]
  for layout, r in rows:
    eff = (r["tokens_per_s"] / (r["devices"] * base)
           if isinstance(r.get("tokens_per_s"), float) and isinstance(base, float) else None)
    mesh = "1 device, no mesh" if r["mesh"] is None else str(tuple(r["mesh"]))
    lines.append(f"| {layout} | {mesh}{' (largest batch)' if r['largest'] else ''} | "
                 f"{r['devices']} | {r['batch']} | {fmt(r.get('tokens_per_s'), '%.0f')} | "
                 f"{fmt(r.get('step_ms'), '%.2f')} | {fmt(eff, '%.2f')} | "
                 f"{fmt(r.get('init_s'), '%.1f')} | {fmt(r.get('compile_s'), '%.1f')} |")
  if single.get("skipped"):
    lines += ["", f"Skipped to stay within --budget-s: {', '.join(single['skipped'])}."]
  for c in single["collectives"]:
    lines += ["", f"Collectives of the decode step on {tuple(c['mesh'])} at batch {c['batch']} "
              f"(compiled HLO): {c['per_layer_bytes']:,} bytes per layer", "",
              "| where | op | result | bytes | group | count |", "|---|---|---|---|---|---|"]
    for where in ("per_layer", "rest"):
      lines += [f"| {where.replace('_', ' ')} | {x['op']} | `{x['type']}` | {x['bytes']:,} | "
                f"{x['group']} | {x['count']} |" for x in c[where]]
    if "all_reduce_us" in c:
      lines += ["", f"One per-layer all-reduce measured alone: {c['all_reduce_us']:.1f} us; "
                f"x {info['model']}'s layers and per-layer count = "
                f"{c['per_step_all_reduce_ms']:.2f} ms per decode step."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
