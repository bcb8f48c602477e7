"""The ``hydragen`` command line.

    hydragen generate --prompt "Write a haiku about the sea." --num-samples 8 --max-new-tokens 32

:data:`COMMANDS` is the whole table: a command's name (one word, or a group and a word such as
``"bench decode"``) -> its help and the function that adds its arguments to an argparse
subparser and sets ``handler`` (``parser.set_defaults(handler=...)``). The handler gets the
parsed ``argparse.Namespace`` and returns an exit status. Model loading and compilation happen
inside handlers, so ``hydragen --help`` only costs the imports.

Errors: a handler raises :class:`~models.errors.UsageError` (or the library raises
``ValueError``/``OSError``); :func:`main` prints one line ``hydragen <command>: error: ...``
and returns 2 (``--debug``: the traceback instead). Ctrl-C returns 130.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Callable, NamedTuple, Optional, Sequence

from models.bench import (compare, decode, engine, memory, paged, sampler, sharded, startup, train,
                          tree)
from models.bench import serve as bench_serve
from models.cli import generate, serve
from models.errors import UsageError
from models.training import addition


class Command(NamedTuple):
  help: str
  configure: Callable[[argparse.ArgumentParser], None]


COMMANDS: dict[str, Command] = {
    "generate": Command(generate.HELP, generate.configure),
    "serve": Command(serve.HELP, serve.configure),
    "bench decode": Command(decode.HELP, decode.configure),
    "bench tree": Command(tree.HELP, tree.configure),
    "bench sampler": Command(sampler.HELP, sampler.configure),
    "bench compare": Command(compare.HELP, compare.configure),
    "bench sharded": Command(sharded.HELP, sharded.configure),
    "bench train": Command(train.HELP, train.configure),
    "bench startup": Command(startup.HELP, startup.configure),
    "bench engine": Command(engine.HELP, engine.configure),
    "bench paged": Command(paged.HELP, paged.configure),
    "bench memory": Command(memory.HELP, memory.configure),
    "bench serve": Command(bench_serve.HELP, bench_serve.configure),
    "train grpo": Command(addition.HELP, addition.configure),
}

# Help of the command groups (the first word of a nested command's name).
GROUPS = {"bench": "Benchmarks: hydragen bench decode | tree | sampler | compare | sharded | "
                   "train | startup | engine | paged | memory | serve.",
          "train": "Fine-tuning: hydragen train grpo."}


class _Parser(argparse.ArgumentParser):
  """argparse, with its errors as one line (no usage block) and exit status 2."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog="hydragen", description="Fast decoding of many sequences that share prompt text "
      "(Hydragen shared-prefix attention in JAX).")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser)
  groups: dict[str, argparse._SubParsersAction] = {}
  for name, (help_text, configure) in sorted(COMMANDS.items()):
    group, _, member = name.partition(" ")
    if not member:
      sub = subparsers.add_parser(name, help=help_text, description=help_text)
    else:
      if group not in groups:
        text = GROUPS.get(group, f"{group} commands")
        groups[group] = subparsers.add_parser(group, help=text, description=text).add_subparsers(
            dest=group, metavar=group.upper(), required=True, parser_class=_Parser)
      sub = groups[group].add_parser(member, help=help_text, description=help_text)
    configure(sub)
    sub.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub.set_defaults(prog=sub.prog)
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs a command: its exit status (2: bad input, printed as one line; 130: interrupted)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  debug, prog = "--debug" in argv, "hydragen"
  try:
    try:
      args, extra = build_parser().parse_known_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse printed already
      return e.code if isinstance(e.code, int) else 2
    prog = args.prog
    if extra:
      raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
    interrupted = []
    status = _run_noting_sigint(args, interrupted)
    if interrupted:  # a Ctrl-C whose KeyboardInterrupt Python swallowed (e.g. in a GC callback)
      raise KeyboardInterrupt
    return status
  except KeyboardInterrupt:
    if debug:
      raise
    print(f"\n{prog}: interrupted", file=sys.stderr)
    return 130
  except Exception as e:  # noqa: BLE001 -- every error is one line unless --debug
    if debug:
      raise
    if "KeyboardInterrupt" in str(e):  # Ctrl-C inside a host callback of a running program
      print(f"\n{prog}: interrupted", file=sys.stderr)
      return 130
    print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
    return 2


def _run_noting_sigint(args: argparse.Namespace, interrupted: list) -> int:
  """``args.handler(args)``, with SIGINT noted in ``interrupted`` as well as raised: Python
  drops a KeyboardInterrupt raised inside a callback it calls (the garbage collector's, a
  host callback's), and the command would then end as if never interrupted."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
    return int(args.handler(args) or 0)  # SIGINT ignored or handled by the caller: leave it

  def on_sigint(signum, frame):
    interrupted.append(signum)
    raise KeyboardInterrupt

  previous = signal.signal(signal.SIGINT, on_sigint)
  try:
    return int(args.handler(args) or 0)
  finally:
    signal.signal(signal.SIGINT, previous)


def _one_line(e: Exception) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  if isinstance(e, (UsageError, ValueError, OSError)):
    return text
  return f"{type(e).__name__}: {text} (--debug shows the traceback)"
