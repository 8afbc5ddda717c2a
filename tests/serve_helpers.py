"""A real server for the serving tests: uvicorn in a thread on a free loopback port, the engine
sharing the tiny model and its compiled programs with ``engine_helpers``."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn
from engine_helpers import make_engine

from mambacache.serve.app import create_app
from mambacache.serve.tokenizer import ByteTokenizer

MODEL = "tiny"
# One configuration for every test server, so that they share compiled programs.
SERVER = {"scheduler.max_running_requests": 16, "serve.max_waiting": 64,
          "serve.warmup_max_seq_len": 64}


@dataclasses.dataclass
class ServerHandle:
    url: str  # http://127.0.0.1:PORT
    server: Any  # mambacache.serve.app.Server
    engine: Any
    tokenizer: ByteTokenizer

    def on_engine(self, fn, timeout_s: float = 60.0):
        """``fn(engine)`` in the engine thread, between steps."""
        return self.server.loop.call_soon(fn).result(timeout=timeout_s)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no request is in flight and the engine holds none."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.server.loop.in_flight == 0 and not self.on_engine(lambda e: e.has_unfinished()):
                return
            time.sleep(0.05)
        raise AssertionError(f"server not idle after {timeout_s} s: "
                             f"{self.server.loop.in_flight} requests in flight")


@contextlib.contextmanager
def running_server(**overrides: Any) -> Iterator[ServerHandle]:
    engine = make_engine(**SERVER, **overrides)
    tokenizer = ByteTokenizer(engine.model_cfg.vocab_size)
    app = create_app(engine, tokenizer, engine.cfg.serve, model_name=MODEL)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 600  # the warm-up compiles the step programs
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not come up")
            time.sleep(0.1)
        yield ServerHandle(url, app.state.server, engine, tokenizer)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        # The app, its engine and their device buffers sit in reference cycles; freed at exit
        # instead, they kept an xdist worker busy past its shutdown grace (a SIGINT warning).
        gc.collect()
