"""Running the app on uvicorn: in the foreground (the command line) or in a thread (tests, the
load generator).

    server = ServerThread(load, port=0).start()    # returns once the port listens
    server.url, server.wait_ready(60), server.stop()

In the foreground, SIGTERM (and Ctrl-C) makes uvicorn stop accepting connections, let the
answers in progress finish for up to ``drain_s`` seconds, cancel the rest, stop the engine;
:func:`serve` then returns normally (exit status 0 for SIGTERM).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Callable, Optional

import uvicorn

from models.server.app import build_app


def _config(app, host: str, port: int, drain_s: float, log_level: str,
            own_logging: bool = True) -> uvicorn.Config:
  """uvicorn's settings; ``own_logging=False`` leaves the process's logging as it is (a
  server in a thread of a program that has its own)."""
  extra = {} if own_logging else dict(log_config=None)
  return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                        timeout_graceful_shutdown=drain_s, timeout_keep_alive=30,
                        backlog=4096, **extra)


def serve(load: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8000,
          drain_s: float = 30.0, log_level: str = "info") -> Optional[BaseException]:
  """Runs the server until SIGTERM or SIGINT (then drains); returns the model's loading
  error, if any (the server stops at once then). Call from the main thread."""
  failure: list[BaseException] = []
  server: Optional[uvicorn.Server] = None

  def on_load_error(e: BaseException) -> None:
    failure.append(e)
    server.should_exit = True

  server = uvicorn.Server(_config(build_app(load, on_load_error=on_load_error), host, port,
                                  drain_s, log_level))
  # uvicorn catches SIGTERM, drains, then raises it again under the handler it found: this one
  # notes it, so that a drained server exits normally.
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
  try:
    server.run()
  finally:
    signal.signal(signal.SIGTERM, previous)
  return failure[0] if failure else None


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class ServerThread:
  """The server in a background thread of this process (tests, the load generator)."""

  def __init__(self, load: Callable[[], tuple], *, host: str = "127.0.0.1",
               port: Optional[int] = None, drain_s: float = 5.0, log_level: str = "warning"):
    self.host, self.port = host, port or free_port(host)
    self.app = build_app(load)
    self.server = uvicorn.Server(_config(self.app, self.host, self.port, drain_s, log_level,
                                         own_logging=False))
    self.thread = threading.Thread(target=self.server.run, name="hydragen-server", daemon=True)

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  @property
  def state(self):
    return self.app.state.hydragen

  def start(self, timeout: float = 60.0) -> "ServerThread":
    """Starts serving; returns once the port accepts connections (the model may still load)."""
    self.thread.start()
    deadline = time.monotonic() + timeout
    while not self.server.started:  # uvicorn offers no event for it
      if not self.thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the server did not start on {self.url}")
      time.sleep(0.01)
    return self

  def wait_ready(self, timeout: float = 600.0):
    """The backend, once the model is loaded (raises its loading error)."""
    if not self.state.loaded.wait(timeout):
      raise TimeoutError(f"the model did not load in {timeout} s")
    if self.state.error is not None:
      raise self.state.error
    return self.state.backend

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join()
