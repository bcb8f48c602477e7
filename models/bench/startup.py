"""Start-up time: checkpoint loading by stage, and the whole ``hydragen generate`` command.

    hydragen bench startup --runs 5 --out runs/startup

In this process, ``--runs`` times each: opening the checkpoint's metadata (GGUF), building
the tokenizer, and the whole :func:`models.from_pretrained`. Then the command
``hydragen generate --prompt P --num-samples N --max-new-tokens T --json`` in fresh
processes with one persistent compilation cache: a first run fills it (reported as
``cold``), ``--runs`` more find every program there (``warm``); each reports its wall
clock (interpreter start to exit) and the command's own ``load / prefill / compile /
decode`` times. Also the time to import the packages the command imports before loading.
Medians over the runs; writes ``startup.json`` and ``startup.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from models.errors import UsageError

TARGETS = {"load_s": 1.0, "warm_wall_s": 3.0}  # seconds, on a 2-core CPU
HELP = ("Start-up time: checkpoint loading by stage and the whole generate command (cold and "
        "warm compilation cache).")


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="checkpoint (default: the generate command's)")
  p.add_argument("--runs", type=int, default=5, help="timed runs of each part (default 5)")
  p.add_argument("--prompt", default="Name a fruit.")
  p.add_argument("--num-samples", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=12)
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="the command's compilation cache (default: a new temporary directory, "
                 "so that the first run is cold)")
  p.add_argument("--no-command", action="store_true", help="time the loading stages only")
  p.add_argument("--out", default="runs/startup", help="directory for startup.json/.md")
  p.set_defaults(handler=_run)


def _median(values) -> Optional[float]:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def time_stages(path: str, runs: int) -> dict:
  """Seconds of each loading stage, ``runs`` times each, in this process (lists)."""
  from models.checkpoints.loading import from_pretrained
  from models.checkpoints.tokenizer import Tokenizer

  out = dict(open_s=[], tokenizer_s=[], load_s=[])
  for _ in range(runs):
    if path.endswith(".gguf"):
      from models.checkpoints.gguf_reader import GGUFFile

      t0 = time.perf_counter()
      fields = GGUFFile(path).fields
      out["open_s"].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      Tokenizer.from_gguf_fields(fields)
      out["tokenizer_s"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    pretrained = from_pretrained(path)
    import jax
    jax.block_until_ready(pretrained.model)
    out["load_s"].append(time.perf_counter() - t0)
    del pretrained
  return {k: v for k, v in out.items() if v}


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # packages'


def _python_env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  return env


def time_imports(runs: int) -> list[float]:
  """Seconds to import what the command imports before loading, less the interpreter's start."""
  code = ("import models.cli, models.generation.loop, models.checkpoints.loading, "
          "models.parallel.distributed")

  def wall(args):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=_python_env(), cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0

  return [wall(["-c", code]) - wall(["-c", "pass"]) for _ in range(runs)]


def time_command(path: str, prompt: str, num_samples: int, max_new_tokens: int,
                 compile_cache: str) -> dict:
  """One ``hydragen generate ... --json`` in a fresh process: wall clock and its timing."""
  cmd = [sys.executable, "-m", "models.cli", "generate", "--model", path, "--prompt", prompt,
         "--num-samples", str(num_samples), "--max-new-tokens", str(max_new_tokens), "--json",
         "--no-progress", "--compile-cache", compile_cache]
  t0 = time.perf_counter()
  done = subprocess.run(cmd, env=_python_env(), cwd=ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if done.returncode != 0:
    raise RuntimeError(f"bench startup: {' '.join(cmd)} failed ({done.returncode}): "
                       f"{done.stderr.strip()[-2000:]}")
  timing = json.loads(done.stdout)["timing"]
  return dict(wall_s=wall, **{k: timing[k] for k in ("load_s", "prefill_s", "compile_s",
                                                       "decode_s", "cache_hits",
                                                       "cache_requests")})


def run_startup_bench(path: Optional[str] = None, *, runs: int = 5, out: str = "runs/startup",
                      prompt: str = "Name a fruit.", num_samples: int = 2,
                      max_new_tokens: int = 12, compile_cache: Optional[str] = None,
                      command: bool = True) -> dict:
  """Times start-up (see the module docstring); writes ``out/startup.{json,md}``; the report."""
  import jax

  from models.checkpoints.default_model import default_model_path

  if runs < 1:
    raise UsageError(f"--runs must be >= 1; got {runs}")
  path = os.path.abspath(path or default_model_path())
  info = dict(model=path, runs=runs, device=jax.devices()[0].device_kind,
              backend=jax.default_backend(), jax=jax.__version__, cpus=os.cpu_count(),
              date=time.strftime("%Y-%m-%d %H:%M:%S"), python=sys.version.split()[0],
              load_average_start=_load_average(), targets=TARGETS)
  stages = time_stages(path, runs)
  report = dict(info=info, stages=stages, medians={k: _median(v) for k, v in stages.items()})
  if command:
    report["imports_s"] = time_imports(runs)
    report["medians"]["imports_s"] = _median(report["imports_s"])
    with tempfile.TemporaryDirectory(prefix="hydragen-bench-startup-") as tmp:
      cache = compile_cache if compile_cache is not None else tmp
      args = (path, prompt, num_samples, max_new_tokens, cache)
      report["cold"] = time_command(*args)
      report["warm"] = [time_command(*args) for _ in range(runs)]
    info["command"] = (f"hydragen generate --prompt {prompt!r} --num-samples {num_samples} "
                       f"--max-new-tokens {max_new_tokens}")
    for key in report["cold"]:
      report["medians"][f"warm_{key}"] = _median(r[key] for r in report["warm"])
  info["load_average_end"] = _load_average()
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "startup.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(out, "startup.md"), "w") as f:
    f.write(markdown(report))
  return report


def _load_average() -> Optional[float]:
  try:
    return os.getloadavg()[0]
  except OSError:
    return None


def markdown(report: dict) -> str:
  """The report as a Markdown table (medians; every run is in the JSON)."""
  info, med = report["info"], report["medians"]
  fmt = lambda x: "" if x is None else f"{x:.3f}"
  rows = [("open GGUF metadata", med.get("open_s")),
          ("build the tokenizer", med.get("tokenizer_s")),
          ("from_pretrained (all of loading)", med.get("load_s")),
          ("imports before loading", med.get("imports_s"))]
  if "cold" in report:
    cold = report["cold"]
    for key, name in (("load_s", "load"), ("prefill_s", "prefill"), ("compile_s", "compile"),
                      ("decode_s", "decode"), ("wall_s", "whole command (wall clock)")):
      rows.append((f"generate: {name}, warm (cold)",
                   f"{fmt(med.get(f'warm_{key}'))} ({fmt(cold[key])})"))
  lines = [f"Start-up of {os.path.basename(info['model'])} on {info['device']} "
           f"({info['backend']}, {info['cpus']} CPUs), jax {info['jax']}, {info['date']}; "
           f"median of {info['runs']} runs, seconds.", ""]
  if "command" in info:
    lines += [f"Command: `{info['command']}`; warm: every program in the compilation cache "
              f"(cold: the first run, filling it).", ""]
  lines += ["| stage | seconds |", "|---|---|"]
  lines += [f"| {name} | {value if isinstance(value, str) else fmt(value)} |"
            for name, value in rows if value is not None]
  lines += ["", f"Targets: load <= {TARGETS['load_s']} s, warm whole command <= "
            f"{TARGETS['warm_wall_s']} s. Load average (1 min) {info['load_average_start']} at "
            f"the start, {info['load_average_end']} at the end."]
  return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
  report = run_startup_bench(args.model, runs=args.runs, out=args.out, prompt=args.prompt,
                             num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                             compile_cache=args.compile_cache, command=not args.no_command)
  print(markdown(report))
  return 0


if __name__ == "__main__":  # python -m models.bench.startup [flags]
  parser = argparse.ArgumentParser(prog="python -m models.bench.startup", description=HELP)
  configure(parser)
  args = parser.parse_args()
  try:
    sys.exit(args.handler(args))
  except UsageError as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    sys.exit(2)
