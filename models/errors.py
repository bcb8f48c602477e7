"""Errors shared by the command line and the library code it runs."""


class UsageError(Exception):
  """Bad command-line input; the message names the flag or the file (printed as one line)."""
