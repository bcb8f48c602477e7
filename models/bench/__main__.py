"""``python -m models.bench <benchmark> [options]``: the attention-level benchmarks and the
server's load generator (the model-level ones run as ``hydragen bench ...``; ``serve`` both)."""

import sys

from models.bench import attention, backward, serve

BENCHMARKS = {"attention": attention.main, "backward": backward.main, "serve": serve.main}


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in BENCHMARKS:
    print(f"usage: python -m models.bench {{{','.join(BENCHMARKS)}}} [options]",
          file=sys.stderr)
    return 2
  BENCHMARKS[argv[0]](argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())
