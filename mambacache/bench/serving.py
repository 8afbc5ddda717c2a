"""``python -m mambacache.bench_serving --base-url URL --dataset-name ...``: load a running
OpenAI-compatible server and report what a user sees (also ``mambacache-bench-serving``).

Flags follow SGLang's ``bench_serving`` (``--dataset-name generated-shared-prefix|random|
multi-turn``, ``--gsp-*``, ``--random-*``, ``--num-prompts``, ``--request-rate``,
``--max-concurrency``, ``--seed``, ``--output-file``); the workloads are ``bench.workloads``'s, with
token-id prompts drawn over the served model's vocabulary (``/v1/models``). Requests are greedy
and ignore EOS, so every request generates its output length. Arrivals: all at once
(``--request-rate inf``) or Poisson; a multi-turn client sends its next turn when the previous one
finished. Reported: request / input / output throughput, TTFT, TPOT, ITL, end-to-end latency
(mean, p50, p99, seconds) and the share of prompt tokens the server reported cached next to the
ideal share (``IdealHits``, in the order the requests were sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from mambacache.bench.runner import Finished, distribution, summarize
from mambacache.bench.serving_client import Reply, send_completion
from mambacache.bench.workloads import GeneratedSharedPrefix, IdealHits, MultiTurn, NoReuse

DATASETS = ("generated-shared-prefix", "random", "multi-turn")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mambacache.bench_serving",
                                description="Benchmark a running mambacache server.")
    a = p.add_argument
    a("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--model", default=None, help="model name (default: the first of /v1/models)")
    a("--vocab-size", type=int, default=None, help="prompt ids in [0, V) (default: /v1/models)")
    a("--dataset-name", choices=DATASETS, default="generated-shared-prefix")
    a("--num-prompts", type=int, default=64, help="random: number of requests")
    a("--random-input-len", type=int, default=256)
    a("--random-output-len", type=int, default=16)
    a("--random-range-ratio", type=float, default=1.0,
      help="lengths uniform in [len * ratio, len]")
    a("--gsp-num-groups", type=int, default=4)
    a("--gsp-prompts-per-group", type=int, default=16)
    a("--gsp-system-prompt-len", type=int, default=1024)
    a("--gsp-question-len", type=int, default=32)
    a("--gsp-output-len", type=int, default=16)
    a("--multi-turn-num-clients", type=int, default=8)
    a("--multi-turn-num-rounds", type=int, default=4)
    a("--multi-turn-system-prompt-len", type=int, default=128)
    a("--multi-turn-user-len", type=int, default=32)
    a("--multi-turn-output-len", type=int, default=16)
    a("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    a("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a("--warmup-requests", type=int, default=1, help="untimed requests first")
    a("--seed", type=int, default=1)
    a("--disable-stream", action="store_true")
    a("--disable-ignore-eos", action="store_true")
    a("--disable-tqdm", action="store_true")
    a("--output-file", default=None, help="append the result as one JSON line")
    return p.parse_args(argv)


def make_source(args: argparse.Namespace, vocab: int) -> Any:
    """The workload of ``--dataset-name`` (``bench.workloads``), prompts over ``vocab`` ids."""
    if args.dataset_name == "generated-shared-prefix":
        spec: Any = GeneratedSharedPrefix(
            num_groups=args.gsp_num_groups, prompts_per_group=args.gsp_prompts_per_group,
            system_prompt_len=args.gsp_system_prompt_len, question_len=args.gsp_question_len,
            output_len=args.gsp_output_len)
    elif args.dataset_name == "random":
        spec = NoReuse(num_prompts=args.num_prompts, input_len=args.random_input_len,
                       output_len=args.random_output_len, range_ratio=args.random_range_ratio)
    else:
        spec = MultiTurn(num_clients=args.multi_turn_num_clients,
                         num_rounds=args.multi_turn_num_rounds,
                         system_prompt_len=args.multi_turn_system_prompt_len,
                         user_len=args.multi_turn_user_len, output_len=args.multi_turn_output_len)
    return spec.source(vocab, args.seed)


class Run:
    """One benchmark pass: dispatches the source's items, follows up multi-turn clients."""

    def __init__(self, args: argparse.Namespace, http: httpx.AsyncClient, model: str,
                 source: Any):
        self.args, self.http, self.model, self.source = args, http, model, source
        self.ideal = IdealHits()
        self.replies: list[tuple[int, Reply]] = []  # (prompt length, reply)
        self.sem = asyncio.Semaphore(args.max_concurrency or 1 << 30)
        self.tasks: set[asyncio.Task] = set()
        self.bar = None

    def spawn(self, item: Any) -> None:
        task = asyncio.create_task(self.one(item))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def one(self, item: Any) -> None:
        async with self.sem:
            self.ideal.send(item.prompt)
            reply = await send_completion(
                self.http, model=self.model, prompt=item.prompt, max_tokens=item.max_new_tokens,
                stream=not self.args.disable_stream, ignore_eos=not self.args.disable_ignore_eos)
        self.replies.append((len(item.prompt), reply))
        if self.bar is not None:
            self.bar.update(1)
        if reply.error is None:
            self.ideal.insert(list(item.prompt) + reply.output_ids[:-1])
            nxt = self.source.follow_up(item, reply.output_ids)
            if nxt is not None:
                self.spawn(nxt)

    async def run(self) -> float:
        """Send everything; the wall time in seconds."""
        from tqdm import tqdm

        loop = asyncio.get_running_loop()
        items = self.source.start()
        rate = self.args.request_rate
        rng = np.random.default_rng(self.args.seed + 1)
        gaps = rng.exponential(1.0 / rate, len(items)) if np.isfinite(rate) else [0.0] * len(items)
        self.bar = tqdm(total=self.source.total, unit="req", disable=self.args.disable_tqdm,
                        dynamic_ncols=True)
        t0 = loop.time()
        for item, gap in zip(items, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            self.spawn(item)
        while self.tasks:
            await asyncio.gather(*list(self.tasks))
        self.bar.close()
        return loop.time() - t0


def report(replies: list[tuple[int, Reply]], duration_s: float, ideal: IdealHits
           ) -> dict[str, Any]:
    """Throughputs, latency distributions (seconds), cached share vs ideal."""
    done = [Finished(n, len(r.output_ids), r.cached_tokens, r.ttft_s, r.latency_s, r.error)
            for n, r in replies]
    out = summarize(done, duration_s)
    ok = [r for _, r in replies if r.error is None]
    out.update(distribution("itl", [x for r in ok for x in r.itl_s]))
    prompt = sum(n for n, r in replies if r.error is None)
    cached = sum(r.cached_tokens for r in ok)
    out.update(cached_tokens=cached, cached_share=cached / prompt if prompt else 0.0,
               ideal_cached_share=ideal.rate,
               errors=sorted({r.error for _, r in replies if r.error})[:5])
    return out


async def _server_info(http: httpx.AsyncClient) -> dict[str, Any]:
    resp = await http.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url or f"http://{args.host}:{args.port}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as http:
        info = await _server_info(http) if args.model is None or args.vocab_size is None else {}
        model = args.model or info["id"]
        vocab = args.vocab_size or int(info["vocab_size"])
        warm_rng = np.random.default_rng(args.seed + 12345)
        for _ in range(args.warmup_requests):
            warm = await send_completion(http, model=model, max_tokens=2,
                                         prompt=warm_rng.integers(0, vocab, 16).tolist())
            if warm.error is not None:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        run = Run(args, http, model, make_source(args, vocab))
        duration_s = await run.run()
    result = {"base_url": base, "model": model, "dataset_name": args.dataset_name,
              "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
              "seed": args.seed}
    return result | report(run.replies, duration_s, run.ideal)


def format_result(r: dict[str, Any]) -> str:
    ms = lambda k: "-" if r.get(k) is None else f"{1e3 * r[k]:.1f}"
    rows = [("completed / failed", f"{r['completed']} / {r['failed']}"),
            ("duration (s)", f"{r['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("input / output throughput (tok/s)",
             f"{r['input_throughput']:.0f} / {r['output_throughput']:.1f}"),
            ("cached share (ideal)", f"{r['cached_share']:.4f} ({r['ideal_cached_share']:.4f})")]
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        rows.append((f"{name} mean / p50 / p99 (ms)",
                     " / ".join(ms(f"{name}_{s}") for s in ("mean", "p50", "p99"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = asyncio.run(run_benchmark(args))
    print(format_result(result))
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
