"""Benchmark output: the on/off ratios, a plain-text table, the JSON file and an optional PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RATIO_KEYS = ("request_throughput", "input_throughput", "output_throughput",
              "total_token_throughput", "ttft_mean", "tpot_mean", "e2e_latency_mean",
              "computed_prefill_tokens")

# (key, label, format) rows of the table
ROWS = (
    ("request_throughput", "request throughput (req/s)", "{:.2f}"),
    ("input_throughput", "input throughput (tok/s)", "{:.1f}"),
    ("output_throughput", "output throughput (tok/s)", "{:.1f}"),
    ("ttft_mean", "TTFT mean (ms)", "ms"),
    ("ttft_p50", "TTFT p50 (ms)", "ms"),
    ("ttft_p99", "TTFT p99 (ms)", "ms"),
    ("tpot_mean", "TPOT mean (ms)", "ms"),
    ("tpot_p50", "TPOT p50 (ms)", "ms"),
    ("tpot_p99", "TPOT p99 (ms)", "ms"),
    ("e2e_latency_mean", "latency mean (ms)", "ms"),
    ("e2e_latency_p99", "latency p99 (ms)", "ms"),
    ("hit_rate", "hit rate", "{:.4f}"),
    ("ideal_hit_rate", "ideal hit rate", "{:.4f}"),
    ("computed_prefill_tokens", "computed prefill tokens", "{:d}"),
    ("peak_token_usage", "peak token usage", "{:.3f}"),
    ("peak_mamba_usage", "peak state usage", "{:.3f}"),
    ("snapshots_kept", "snapshots kept", "{:d}"),
    ("snapshots_skipped", "snapshots skipped", "{:d}"),
    ("step_programs", "step shapes used", "{:d}"),
    ("programs_compiled", "XLA compiles in steps", "{:d}"),
    ("timed_compiles", "compiled while timed", "{:d}"),
    ("timed_compile_s", "compile s while timed", "{:.2f}"),
    ("host_share", "host share of wall time", "{:.3f}"),
    ("spec_verify_steps", "verifies (speculative)", "{:d}"),
    ("spec_verify_rows", "verify rows (a tree's: one per branch)", "{:d}"),
    ("spec_accept_rate", "draft acceptance rate", "{:.3f}"),
    ("spec_tokens_per_verify", "tokens per verify row", "{:.2f}"),
    ("spec_verify_width", "tokens verified per verify", "{:.2f}"),
    ("device_idle_share", "no step in flight (share)", "{:.3f}"),
    ("host_bound_share", "steps waiting on the host", "{:.3f}"),
    ("duration_s", "duration (s)", "{:.2f}"),
    ("completed", "completed requests", "{:d}"),
    ("failed", "failed requests", "{:d}"),
)


def ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    """``on / off`` for the throughputs (and latencies, prefill work); None where off is 0."""
    return {k: (on[k] / off[k] if off.get(k) else None) for k in RATIO_KEYS if k in on}


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{1000 * value:.1f}"
    if fmt == "{:d}":
        return str(int(value))
    return fmt.format(value)


def modes_of(result: dict[str, Any]) -> list[str]:
    """The two compared modes, on first: ``cache_on``/``cache_off`` or ``spec_on``/``spec_off``."""
    return list(result.get("modes", ("cache_on", "cache_off")))


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table: one row per metric, columns on, off, on / off."""
    modes = modes_of(result)
    on, off, rat = result[modes[0]], result[modes[1]], result["ratios"]
    names = [m.replace("_", " ") for m in modes]
    lines = [f"{'metric':<28}{names[0]:>14}{names[1]:>14}{'on/off':>10}", "-" * 66]
    for key, label, fmt in ROWS:
        if key not in on:
            continue
        r = rat.get(key)
        lines.append(f"{label:<28}{_fmt(on[key], fmt):>14}{_fmt(off[key], fmt):>14}"
                     f"{'-' if r is None else f'{r:.3f}x':>10}")
    lines.append(f"warm-up (untimed): {result['warmup_s']:.1f} s, "
                 f"{result.get('warmup_programs', '?')} step programs (sequences up to "
                 f"{result.get('warmup_max_seq_len', '?')} tokens), "
                 f"{result['warmup_programs_compiled']} XLA compiles "
                 f"({result.get('warmup_compile_s', 0.0):.1f} s); "
                 f"timed passes per mode: {len(result['runs'][modes[0]])} (medians)")
    bad = [m for m in modes if result[m].get("timed_compiles")]
    if bad:
        lines.append("COMPILED WHILE TIMED (the numbers include compile time): " + ", ".join(
            f"{m} {result[m]['timed_compiles']} ({result[m]['timed_compile_s']:.1f} s)"
            for m in bad))
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")


def require_matplotlib():
    """``matplotlib.pyplot`` (Agg backend), or a ``RuntimeError`` saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'mambacache[plot]' "
                           "(or pip install matplotlib)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(result: dict[str, Any], path: str | Path) -> None:
    """Three bar panels, cache on vs off: throughputs, latencies (ms), hit rate vs ideal."""
    plt = require_matplotlib()
    modes = modes_of(result)
    on, off = result[modes[0]], result[modes[1]]
    names = [m.replace("_", " ") for m in modes]
    panels = (("throughput", ("request_throughput", "input_throughput", "output_throughput"), 1),
              ("latency (ms)", ("ttft_mean", "ttft_p99", "tpot_mean", "e2e_latency_mean"), 1000),
              ("hit rate", ("hit_rate", "ideal_hit_rate"), 1))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (title, keys, scale) in zip(axes, panels, strict=True):
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [(on[k] or 0) * scale for k in keys], 0.4, label=names[0])
        ax.bar([x + 0.2 for x in xs], [(off[k] or 0) * scale for k in keys], 0.4, label=names[1])
        ax.set_xticks(list(xs), [k.replace("_", "\n") for k in keys], fontsize=8)
        ax.set_title(title)
        if title == "throughput":
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"{result.get('config', '')} ({result['workload']['kind']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MD_HEADER = ("| preset | mode | req/s | input tok/s | output tok/s | TTFT mean / p99 (ms) "
             "| TPOT mean (ms) | hit rate (ideal) | computed prefill | on/off throughput |\n"
             "|---|---|---|---|---|---|---|---|---|---|")


def markdown_rows(result: dict[str, Any]) -> list[str]:
    """Two README table rows (cache on, cache off) for one ``--out`` JSON."""
    name = Path(str(result.get("config", "?"))).stem
    rows = []
    modes = modes_of(result)
    for mode in modes:
        m = result[mode]
        ratio = f"{result['ratios']['request_throughput']:.2f}x" if mode == modes[0] else ""
        label = mode.replace("cache_", "").replace("_", " ")
        rows.append(f"| {name} | {label} | {m['request_throughput']:.2f} "
                    f"| {m['input_throughput']:.0f} | {m['output_throughput']:.1f} "
                    f"| {1000 * m['ttft_mean']:.0f} / {1000 * m['ttft_p99']:.0f} "
                    f"| {_fmt(m['tpot_mean'], 'ms')} "
                    f"| {m['hit_rate']:.3f} ({m['ideal_hit_rate']:.3f}) "
                    f"| {m['computed_prefill_tokens']} | {ratio} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m mambacache.bench_report a.json b.json``: the README's markdown rows."""
    import sys

    print(MD_HEADER)
    for arg in (sys.argv[1:] if argv is None else argv):
        print("\n".join(markdown_rows(json.loads(Path(arg).read_text()))))


if __name__ == "__main__":
    main()
