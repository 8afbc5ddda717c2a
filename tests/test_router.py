"""Two servers behind SGLang's router and gateway, from their PyPI wheels (``sglang-router``,
``smg``: the ``router`` extra), on loopback only (issue 31, item 6).

Through each: completions, chat and streams succeed; a shared-prefix workload (groups of
requests sharing a long prefix, sent one at a time in a fixed shuffled order) gets a larger
cached share through the ``cache_aware`` policy than through ``round_robin``, which sends a
group's requests to both replicas so each computes the prefix.

Marker ``router`` (excluded by default): ``pytest -m router -n 0 tests/test_router.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from serve_helpers import MODEL, running_server

NO_WARMUP = {"serve.warmup": False}  # the first requests compile what they use

pytestmark = pytest.mark.router

ROUTERS = ("sglang-router", "smg")
GROUPS, PER_GROUP, PREFIX_CHARS, SUFFIX_CHARS = 4, 6, 240, 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_binary(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[router]'")
    return found


@contextlib.contextmanager
def router(name: str, workers: list[str], policy: str, log: Path) -> Iterator[str]:
    """``name launch`` on a free loopback port in front of ``workers``; its URL once every
    worker is registered and healthy."""
    port = free_port()
    cmd = [router_binary(name), "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *workers, "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "warn"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError):
                listed = httpx.get(f"{url}/workers", timeout=5).json()
                if sum(w["is_healthy"] for w in listed["workers"]) == len(workers):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up: {log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def servers():
    with running_server(**NO_WARMUP) as a, running_server(**NO_WARMUP) as b:
        yield [a, b]


def shared_prefix_prompts(seed: int) -> list[str]:
    """``GROUPS`` prefixes of ``PREFIX_CHARS`` letters, ``PER_GROUP`` suffixes each, shuffled.
    A fresh ``seed`` per run: no run finds another run's prefixes in the replicas' caches."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))

    def text(n: int) -> str:
        return "".join(rng.choice(letters, n))

    prompts = [p + text(SUFFIX_CHARS) for p in (text(PREFIX_CHARS) for _ in range(GROUPS))
               for _ in range(PER_GROUP)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def cached_share(url: str, prompts: list[str]) -> float:
    prompt_tokens = cached = 0
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                       timeout=300) as client:
        for p in prompts:
            out = client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
            prompt_tokens += out.usage.prompt_tokens
            cached += out.usage.prompt_tokens_details.cached_tokens
    return cached / prompt_tokens


def check_surface(url: str) -> None:
    """Completions, chat, both streamed, and SGLang's /generate, through the router."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                       timeout=300) as client:
        out = client.completions.create(model=MODEL, prompt="through", max_tokens=3,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.completion_tokens == 3
        chunks = list(client.completions.create(
            model=MODEL, prompt="stream", max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 4
        chat_chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, extra_body={"ignore_eos": True}))
        assert chat_chunks[-1].choices[0].finish_reason == "length"
    gen = httpx.post(f"{url}/generate", timeout=300, json={
        "text": "native", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert gen.status_code == 200, gen.text
    assert gen.json()["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("name", ROUTERS)
def test_router_cache_aware_beats_round_robin(servers, name, tmp_path):
    workers = [s.url for s in servers]
    shares = {}
    for seed, policy in enumerate(("round_robin", "cache_aware")):
        with router(name, workers, policy, tmp_path / f"{policy}.log") as url:
            check_surface(url)
            shares[policy] = cached_share(url, shared_prefix_prompts(seed + 10 * len(name)))
    print(f"{name}: cached share {shares}")
    # cache_aware computes each prefix once (one miss in PER_GROUP), round_robin ~twice
    assert shares["cache_aware"] > shares["round_robin"] + 0.05, shares
    for s in servers:
        s.wait_idle()
        s.on_engine(lambda e: e.check_integrity())
