"""``python -m mambacache.bench.soak``: a bounded loopback soak of the server, RSS per phase.

Starts ``python -m mambacache.serve`` as a child on 127.0.0.1 (a free port), waits for
``/health``, then runs ``--phases`` phases of ``--phase-s`` seconds in which ``--clients``
concurrent clients loop over requests: token-id prompts that share system prefixes, streamed or
not, and every ``--disconnect-every``-th one dropped by its client mid-answer. After each phase
it waits until the server holds no request and reads the server's resident memory
(``/proc/PID/status`` ``VmRSS``, and ``VmHWM``) and pool usage from ``/metrics``: the lines show
whether memory levels off once the pools are back at 0. Nothing leaves the machine; the run
ends after ``phases * phase_s`` seconds plus the drains (``--drain-s`` at most each).
``--env NAME=VALUE`` (repeatable) sets the server's environment (e.g. ``MALLOC_ARENA_MAX=2``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mambacache.bench.soak", description=__doc__
                                .split("\n\n")[0])
    p.add_argument("--config", default=None, help="engine TOML for the server")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--phases", type=int, default=6)
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect-every", type=int, default=10)
    p.add_argument("--drain-s", type=float, default=120.0)
    p.add_argument("--startup-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result as one JSON object")
    return p.parse_args(argv)


def proc_memory_mb(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` (peak) of ``pid`` in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out["VmRSS"], "peak_rss_mb": out["VmHWM"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mambacache.serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    cmd += ["--config", args.config] if args.config else []
    for kv in args.set:
        cmd += ["--set", kv]
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    return subprocess.Popen(cmd, env=env)


async def _wait_healthy(http: httpx.AsyncClient, proc: subprocess.Popen, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if (await http.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {limit_s} s")


async def _metrics(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


class Clients:
    """``--clients`` loops of requests until ``stop_at``; counts what came back."""

    def __init__(self, http: httpx.AsyncClient, args: argparse.Namespace, vocab: int):
        self.http, self.args, self.vocab = http, args, vocab
        self.rng = random.Random(args.seed)
        self.systems = [[self.rng.randrange(vocab) for _ in range(self.rng.randint(64, 400))]
                        for _ in range(8)]
        self.sent = 0
        self.counts: dict[str, int] = {}

    def _body(self) -> dict[str, Any]:
        rng = self.rng
        prompt = rng.choice(self.systems) + [rng.randrange(self.vocab)
                                             for _ in range(rng.randint(8, 200))]
        return {"prompt": prompt, "max_tokens": rng.randint(1, self.args.max_tokens),
                "temperature": rng.choice([0.0, 0.7]), "ignore_eos": True,
                "stream": rng.random() < 0.5}

    async def _one(self) -> str:
        self.sent += 1
        body = self._body()
        drop = self.args.disconnect_every and self.sent % self.args.disconnect_every == 0
        if drop:  # the client leaves after the first chunk or 0.2 s
            with contextlib.suppress(httpx.TimeoutException):
                async with self.http.stream("POST", "/v1/completions", json=body | {
                        "max_tokens": 200}, timeout=0.2) as resp:
                    async for _ in resp.aiter_lines():
                        break
            return "dropped"
        resp = await self.http.post("/v1/completions", json=body, timeout=600)
        return str(resp.status_code)

    async def _loop(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            try:
                key = await self._one()
            except httpx.HTTPError as err:
                key = type(err).__name__
            self.counts[key] = self.counts.get(key, 0) + 1

    async def phase(self, seconds: float) -> dict[str, int]:
        self.counts = {}
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(self._loop(stop_at) for _ in range(self.args.clients)))
        return dict(self.counts)


async def _drain(http: httpx.AsyncClient, limit_s: float) -> dict[str, float]:
    deadline = time.monotonic() + limit_s
    while True:
        m = await _metrics(http)
        busy = m.get("mambacache_running_requests", 0) + m.get("mambacache_waiting_requests", 0)
        if not busy or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    proc = start_server(args, port)
    limits = httpx.Limits(max_connections=args.clients + 8)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                     timeout=600) as http:
            t0 = time.monotonic()
            await _wait_healthy(http, proc, args.startup_s)
            vocab = (await http.get("/v1/models")).json()["data"][0]["vocab_size"]
            rows = [{"phase": 0, "requests": {}, "startup_s": round(time.monotonic() - t0, 1),
                     **proc_memory_mb(proc.pid)}]
            print(json.dumps(rows[0]), flush=True)
            clients = Clients(http, args, min(vocab, 256))
            for i in range(1, args.phases + 1):
                counts = await clients.phase(args.phase_s)
                m = await _drain(http, args.drain_s)
                rows.append({"phase": i, "requests": counts, **proc_memory_mb(proc.pid),
                             "kv_pool_usage": m.get("mambacache_kv_pool_usage"),
                             "state_pool_usage": m.get("mambacache_state_pool_usage"),
                             "running": m.get("mambacache_running_requests")})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    rss = [r["rss_mb"] for r in rows[1:]]
    return {"phases": rows, "rss_first_mb": rss[0] if rss else None,
            "rss_last_mb": rss[-1] if rss else None,
            "rss_growth_last_half_mb": rss[-1] - rss[len(rss) // 2] if rss else None}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = soak_result = asyncio.run(soak(args))
    if args.out:
        Path(args.out).write_text(json.dumps(soak_result, indent=1))
    return result


if __name__ == "__main__":
    main()
