"""The server while it starts: ``/health`` answers 503 with the start's stage (the warm-up's
"compiled N of M programs") until the engine is ready, then 200; each stage is logged."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import uvicorn
from engine_helpers import make_engine, tiny_model
from serve_helpers import SERVER

from mambacache.serve.app import create_app
from mambacache.serve.tokenizer import ByteTokenizer


def test_health_says_the_stage_until_ready(caplog):
    engine = make_engine(**SERVER)
    release = threading.Event()

    def slow_warmup(max_seq_len=None, logit_controls=False, progress=None):
        progress("compiled 1 of 2 programs (decode 4 tokens x 64 pages: 0.1 s)")
        assert release.wait(60)
        progress("compiled 2 of 2 programs (extend 16 tokens x 64 pages: 0.1 s)")
        return {"programs": 2}

    engine.warmup = slow_warmup
    app = create_app(engine, ByteTokenizer(engine.model_cfg.vocab_size), engine.cfg.serve,
                     model_name="tiny")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog.set_level(logging.INFO, logger="mambacache.serve.engine_loop")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                if "compiled 1 of 2" in r.json().get("stage", ""):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no stage from /health"
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        release.set()
        while (r := httpx.get(f"{url}/health", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.05)
        assert r.json() == {"status": "ok"}
        assert app.state.server.loop.stage == "ready"
        logged = caplog.text
        assert "start: compiled 1 of 2 programs" in logged and "start: ready" in logged
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_the_server_says_it_warms_up_so_its_programs_compile_while_loading(monkeypatch):
    import pytest

    import mambacache.engine.engine as engine_mod
    from mambacache.serve.__main__ import main

    seen, apps = [], []

    def fake_engine(cfg, **kwargs):
        seen.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_mod, "Engine", fake_engine)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    for extra, want in ((["--set", "serve.warmup_max_seq_len=64"], 64),
                        (["--set", "serve.warmup=false"], None)):
        main(extra)
        assert seen == []  # the engine is built in the engine thread, once the app runs
        with pytest.raises(RuntimeError, match="stop here"):
            apps.pop().state.server.loop._build()
        assert seen.pop() == {"warmup_max_seq_len": want}


def test_health_says_the_weights_load_before_the_engine_exists():
    from fastapi.testclient import TestClient

    from mambacache.config import EngineConfig

    cfg = EngineConfig.load(None, SERVER)
    release = threading.Event()

    def build():
        assert release.wait(60)
        return make_engine(**SERVER)

    app = create_app(build, ByteTokenizer(tiny_model()[0].vocab_size), cfg.serve, model_name="tiny",
                     max_running=cfg.scheduler.max_running_requests)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and "loading the weights" in r.json()["stage"], r.json()
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"], r.json()
        assert r.headers["retry-after"] == "5"
        release.set()
        deadline = time.monotonic() + 120
        while (r := client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.json()


def test_a_failed_load_is_an_error_on_health():
    from fastapi.testclient import TestClient

    from mambacache.config import EngineConfig

    cfg = EngineConfig.load(None, SERVER)

    def build():
        raise ValueError("model.path 'nowhere' holds neither config.json nor model.json")

    app = create_app(build, ByteTokenizer(tiny_model()[0].vocab_size), cfg.serve,
                     model_name="tiny", max_running=4)
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while (r := client.get("/health")).status_code == 503:
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.05)
        assert r.status_code == 500 and "nowhere" in r.json()["error"], r.json()
