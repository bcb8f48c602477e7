"""``python -m jax_shared_attn.bench <benchmark> [options]``."""

import sys

BENCHMARKS = {"attention": "jax_shared_attn.bench.attention",
              "backward": "jax_shared_attn.bench.backward"}


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in BENCHMARKS:
    print(f"usage: python -m jax_shared_attn.bench {{{','.join(BENCHMARKS)}}} [options]",
          file=sys.stderr)
    return 2
  import importlib
  importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
