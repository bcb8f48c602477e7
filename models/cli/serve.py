"""``hydragen serve``: the OpenAI-compatible HTTP server (docs/server.md).

    hydragen serve                                    # SmolLM2-135M-Instruct on 127.0.0.1:8000
    hydragen serve --model path/to/model.gguf --port 8080 --num-pages 8192
    hydragen serve --model llama-3-8b --dtype bfloat16   # a preset name: random weights

The engine flags (:mod:`models.bench.engine_flags`) are shared with ``hydragen bench serve``.
"""

from __future__ import annotations

import argparse
import sys

from models.bench import engine_flags
from models.errors import UsageError

HELP = "Serve a model over the OpenAI API (completions, chat completions) on the engine."


def configure(p: argparse.ArgumentParser) -> None:
  engine_flags.add_engine_arguments(p)
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
  p.add_argument("--port", type=int, default=8000, help="default 8000")
  p.add_argument("--served-model-name", default=None,
                 help="the model's name in the API (default: the file or preset name)")
  p.add_argument("--drain-timeout", type=float, default=30.0,
                 help="on SIGTERM, seconds the answers in progress may take before they are "
                 "cancelled (default 30)")
  p.add_argument("--precompile", action="store_true",
                 help="compile every device program the buckets allow before /health turns 200 "
                 "(needs --level-buckets, --segment-buckets and --page-buckets with cascade on; "
                 "keep the buckets few: the count is their product)")
  p.add_argument("--log-level", default="info",
                 choices=("critical", "error", "warning", "info", "debug"))
  p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
  engine_flags.check_engine_args(args)
  if not 0 <= args.port <= 65535:
    raise UsageError(f"--port must lie in [0, 65535]; got {args.port}")
  if not args.drain_timeout >= 0:
    raise UsageError(f"--drain-timeout must be >= 0; got {args.drain_timeout}")
  config = engine_flags.engine_config(args)  # the engine's own checks, before anything loads
  if args.precompile:
    from models.serving.device import unbounded_buckets
    unbounded = unbounded_buckets(config)
    if unbounded:
      flags = ", ".join("--" + name.replace("_", "-") for name in unbounded)
      raise UsageError(f"--precompile needs {flags} (with cascade on, powers of two have no "
                       "bound)")
  if args.model is None:
    from models.checkpoints.default_model import default_model_path
    default_model_path()  # a missing default model is a usage error now, not in the server
  try:
    from models.server.launch import serve
  except ImportError as e:
    raise UsageError(f"hydragen serve needs the serve extra ({e.name} is missing): pip install "
                     "fastapi uvicorn prometheus_client") from None
  print(f"hydragen serve: http://{args.host}:{args.port} (the model loads; GET /health "
        "answers 503 until it is ready)", file=sys.stderr, flush=True)
  error = serve(engine_flags.loader(args, args.served_model_name, precompile=args.precompile),
                host=args.host,
                port=args.port, drain_s=args.drain_timeout, log_level=args.log_level)
  if error is not None:
    raise error if isinstance(error, (UsageError, ValueError, OSError)) else RuntimeError(
        f"loading the model failed: {error}")
  return 0
