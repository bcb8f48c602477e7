"""Shared by the device A/B tools (wide_steps.py; transposed.py until 2026-11-24): their
``attention`` and ``decode`` arguments, and decode points under one setting, appended to a JSON
file."""

import json
import os

from jax_shared_attn.bench import timing


def decode_points(args, setting, json_name: str, tag: dict):
  """``models.bench_decode.run_point`` (random bf16 weights of ``args.model``, the whole prompt
  shared) for every prompt, batch and mode of ``args``, each traced inside ``setting()`` (a
  context manager; settings are read when the decode loop is traced, so one process per
  setting), the rows tagged with ``tag`` and appended to ``args.out/json_name``."""
  from models.bench_decode import device_random_init, run_point
  from models.config import preset
  batches = [int(x) for x in args.batch.split(",")]
  prefixes = [int(x) for x in args.prefix.split(",")]
  config = preset(args.model)
  longest = max(prefixes) + args.new_tokens + args.profile_steps + 1
  config = config.replace(dtype="bfloat16",
                          max_position_embeddings=max(config.max_position_embeddings, longest))
  model = device_random_init(config, seed=0)
  path = os.path.join(args.out, json_name)
  rows = json.load(open(path))["rows"] if os.path.exists(path) else []
  for p in prefixes:
    for b in batches:
      for mode in args.modes.split(","):
        with setting():
          row = run_point(model, mode, b, p, args.new_tokens, impl="auto",
                          profile_steps=args.profile_steps)
        row.update(model=args.model, **tag)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        with open(path, "w") as f:
          json.dump(dict(info=timing.device_info(), rows=rows), f, indent=1)


def add_attention_parser(sub, configs: str, variants: str):
  """The ``attention`` subcommand: ``--configs`` (``shape:B:P:S``), ``--variants``, ``--trials``,
  ``--ceilings``, ``--out``."""
  a = sub.add_parser("attention")
  a.add_argument("--configs", default=configs)
  a.add_argument("--variants", default=variants)
  a.add_argument("--trials", type=int, default=5)
  a.add_argument("--ceilings", type=float, nargs=2, metavar=("BYTES_PER_S", "FLOP_PER_S"),
                 help="copy bandwidth and matmul rate for a floor column (e.g. 2.74e12 7.3e14)")
  a.add_argument("--out", default=".")
  return a


def add_decode_parser(sub, batch: str, prefix: str):
  """The ``decode`` subcommand's common arguments (the caller adds its setting's)."""
  d = sub.add_parser("decode")
  d.add_argument("--model", default="llama-3-8b")
  d.add_argument("--batch", default=batch)
  d.add_argument("--prefix", default=prefix)
  d.add_argument("--new-tokens", type=int, default=128)
  d.add_argument("--modes", default="hydragen")
  d.add_argument("--profile-steps", type=int, default=2)
  d.add_argument("--out", default=".")
  return d
