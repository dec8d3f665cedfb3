"""The printed table, the ratios next to the team's targets, and the JSON file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.latency import cold_text
from bench.timing import fmt


@dataclass(frozen=True)
class Target:
    """rate(numerator) / rate(denominator), and the least ratio the team wants (None: none)."""

    what: str
    numerator: str
    denominator: str
    least: float | None


TARGETS = (
    Target("no-op handler (g0) / raw claim + mark (d)", "g0", "d", 0.7),
    Target("ORM session.add handler (go) / pgqueuer batch 50 (pq50)", "go", "pq50", 1.0),
    Target("batch handler, one INSERT (gb) / raw claim + mark (d)", "gb", "d", 0.7),
    Target("session.execute handler (g) / pgqueuer, job inserts (pq')", "g", "pq'", 1.2),
    Target("session.execute handler (g) / raw + 1 INSERT per row (d')", "g", "d'", 0.6),
    Target("ctx.write handler (gw) / raw + 1 INSERT per row (d')", "gw", "d'", None),
    Target("worker (g) / naive loop (n)", "g", "n", 4.0),
    Target("worker (g) / pgqueuer (pq)", "g", "pq", 1.5),
    Target("2 worker processes (gp2) / 1 process (gp)", "gp2", "gp", 1.6),
    Target("run_worker(), default processes (gr) / 1 process (gp)", "gr", "gp", None),
    Target("outbox.publish (w) / raw INSERT per row (c')", "w", "c'", 0.9),
    Target("outbox.publish_async (wa) / outbox.publish (w)", "wa", "w", None),
    Target("asyncio worker (ga) / worker in a thread (g)", "ga", "g", None),
    Target("2 asyncio workers (ga2) / 2 threads (g2)", "ga2", "g2", None),
    Target("no-op worker, fair claims (f0) / fair_claims=False (f0x)", "f0", "f0x", 0.95),
    Target("no-op worker, a cap that never binds (f0c) / no cap (f0)", "f0c", "f0", 0.9),
    Target("no-op worker, a rate that never binds (f0r) / no cap (f0)", "f0r", "f0", 0.9),
    Target("relay (e) / raw confirmed publish (a)", "e", "a", 0.6),
    Target("pipeline, B's default run() (h) / raw confirmed publish (a)", "h", "a", 0.35),
    Target("pipeline, B's default run() (h) / hand-written pipeline (h_raw)", "h", "h_raw", 0.6),
    Target("dramatiq enqueue (dq) / raw confirmed publish (a)", "dq", "a", None),
)
#: The most commit -> handled latency the team accepts at each offered rate, services as users
#: run them (L): msg/s -> (p50, p99) in ms, None where no bound is set.
LATENCY_MS = {100.0: (15.0, 40.0), 500.0: (None, 50.0), 1000.0: (None, 150.0)}
#: The most L's p50 and p99 may be over the hand-written pipeline's (L_raw) at the same rate.
LATENCY_OVER_RAW = (1.5, 2.0)
RSS_MAX_MB = 150.0


def finish_figures(ctx: Context) -> None:
    for figure in ctx.figures.values():
        limits = [ctx.figures[k].rate for k in figure.limit_of if k in ctx.figures]
        known = [r for r in limits if r]
        if known and len(known) == len(figure.limit_of):
            figure.limit = min(known)


def target_rows(ctx: Context) -> list[dict[str, Any]]:
    """Each target with its measured ratio (None when a figure is missing) and whether it is met."""
    rows = []
    for target in TARGETS:
        num, den = ctx.figures.get(target.numerator), ctx.figures.get(target.denominator)
        ratio = num.rate / den.rate if num and den and num.rate and den.rate else None
        met = None if ratio is None or target.least is None else ratio >= target.least
        rows.append({"what": target.what, "ratio": ratio, "target": target.least, "met": met})
    rows += latency_rows(ctx.results.get("latency", []))
    h = ctx.figures.get("h")
    idle = [r for r in ctx.results.get("latency", []) if r["pipeline"] == "L"]
    if h and h.cpu_us and idle:
        low = min(idle, key=lambda r: r["offered_rate"])
        ratio = low["pipeline_cpu_us"] / h.cpu_us
        rows.append(
            _bound(
                f"CPU us/msg at {low['offered_rate']:,.0f} msg/s (L) / at saturation (h)", ratio, 2
            )
        )
    for memory in ctx.results.get("memory", []):
        rows.append(
            {
                "what": f"RSS of the {memory['role']} process, max (MB); flat",
                "value": memory["max_mb"],
                "target": f"< {RSS_MAX_MB:.0f} MB, flat",
                "met": memory["max_mb"] < RSS_MAX_MB and memory["flat"],
            }
        )
    return rows


def _yes(met: bool | None) -> str:
    return "" if met is None else ("yes" if met else "NO")


def print_table(ctx: Context) -> None:
    finish_figures(ctx)
    header = (
        f"{'fig':<4} {'what':<58} {'rate':>8} {'unit':<6} {'raw limit':>17} {'ratio':>5} "
        f"{'us/msg':>6} {'py/srv/oth':>11}"
    )
    print(f"\n{'=' * len(header)}\n{ctx.n} messages per figure; one run, same servers\n")
    if ctx.figures:
        print(header)
    group = ""
    for f in ctx.figures.values():
        if f.group != group:
            group = f.group
            print(f"-- {group}")
        limit = ""
        if f.limit_of and f.limit:
            names = ",".join(f.limit_of)
            limit = f"{f'min({names})' if len(f.limit_of) > 1 else f'({names})'} {fmt(f.limit)}"
        ratio = f"{f.ratio:.2f}" if f.ratio is not None else ""
        cpu_us = f"{f.cpu_us:.0f}" if f.cpu_us is not None else ""
        cores = "/".join(
            f"{v:.1f}" if v is not None else "?"
            for v in (f.client_cores, f.server_cores, f.other_cores)
        )
        print(
            f"{f.key:<4} {f.title:<58} {fmt(f.rate):>8} {f.unit:<6} {limit:>17} {ratio:>5} "
            f"{cpu_us:>6} {cores:>11}"
        )
    print(
        "\nus/msg = CPU microseconds of the bench's own processes per message."
        "\npy/srv/oth = CPU cores busy during the figure: the bench's processes / the servers"
        f" it started / everything else on the machine ({os.cpu_count()} CPUs). A large 'oth'"
        " means a busy machine: the rates are then low and noisy."
    )
    stages = [ctx.figures[k].rate for k in ("e", "f", "g") if k in ctx.figures]
    h = ctx.figures.get("h")
    if h and h.rate and len(stages) == 3 and all(stages):
        slowest = min(r for r in stages if r)
        print(
            f"(h) / min(e, f, g) = {h.rate / slowest:.2f}: the slowest stage alone "
            f"would allow {fmt(slowest)} msg/s."
        )
    g, d2 = ctx.figures.get("g"), ctx.figures.get("d''")
    if g and d2 and g.rate and d2.rate:
        print(
            f"(g) / (d'') = {g.rate / d2.rate:.2f}: the worker against the same SQL by hand "
            "(claim, one INSERT in a SAVEPOINT per message, mark)."
        )
    low = [f.key for f in ctx.figures.values() if f.ratio is not None and f.ratio < 0.3]
    if low:
        print(f"below 0.3 of the raw limit: {', '.join(low)} (see bench/README.md, profiling)")
    _print_latency(ctx)
    _print_memory(ctx)
    _print_targets(ctx)


def latency_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latency targets: L's bounds, L over L_raw at each rate, L_p1 never ahead of L."""
    by = {(r["pipeline"], r["offered_rate"]): r for r in results}
    rows = []
    for (pipeline, rate), r in by.items():
        if pipeline != "L":
            continue
        for q, bound in zip(("p50", "p99"), LATENCY_MS.get(rate, (None, None)), strict=True):
            if bound is not None:
                rows.append(_bound(f"L {q} at {rate:,.0f} msg/s (ms)", r[f"{q}_ms"], bound))
        raw, p1 = by.get(("L_raw", rate)), by.get(("L_p1", rate))
        for q, most in zip(("p50", "p99"), LATENCY_OVER_RAW, strict=True):
            if raw:
                ratio = r[f"{q}_ms"] / raw[f"{q}_ms"]
                rows.append(_bound(f"L / L_raw, {q} at {rate:,.0f} msg/s", ratio, most))
            if p1:
                ratio = r[f"{q}_ms"] / p1[f"{q}_ms"]
                rows.append(_bound(f"L / L_p1 (1 process), {q} at {rate:,.0f} msg/s", ratio, 1.0))
    return rows


def _bound(what: str, value: float, most: float) -> dict[str, Any]:
    return {"what": what, "value": value, "target": f"<= {most:g}", "met": value <= most}


def _print_latency(ctx: Context) -> None:
    for latency in ctx.results.get("latency", []):
        print(
            f"\n-- latency ({latency['pipeline']}): commit -> handled, {latency['messages']:,}"
            f" messages offered at"
            f" {latency['offered_rate']:,.0f} msg/s (achieved {latency['achieved_rate']:,.0f}),"
            f" {latency['writers']} writer threads"
        )
        print(f"{'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'mean':>8}   py/srv/oth")
        cores = "/".join(
            f"{latency[k]:.1f}" if latency[k] is not None else "?"
            for k in ("client_cores", "server_cores", "other_cores")
        )
        print(
            "".join(f"{latency[k]:>6.1f}ms " for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms"))
            + f"{latency['mean_ms']:>6.1f}ms   {cores}"
        )
        for name, stage in latency.get("stages", {}).items():
            print(f"  {name:<36} p50 {stage['p50_ms']:8.1f} ms   p99 {stage['p99_ms']:8.1f} ms")
        if cold := latency.get("cold"):
            print(f"  {cold_text(cold)}")


def _print_memory(ctx: Context) -> None:
    memory = ctx.results.get("memory")
    if not memory:
        return
    print(f"\n-- memory (M): RSS of one role process over a backlog of {memory[0]['backlog']:,}")
    print(
        f"{'role':<7} {'rows done':>10} {'seconds':>7} {'rows/s':>7} {'idle MB':>7} "
        f"{'max MB':>7} {'final MB':>8} {'drift MB':>8} {'flat':>4}"
    )
    for m in memory:
        print(
            f"{m['role']:<7} {m['done']:>10,} {m['seconds']:>7.0f} {fmt(m['rate']):>7} "
            f"{m['idle_mb']:>7.0f} {m['max_mb']:>7.0f} {m['final_mb']:>8.0f} "
            f"{m['drift_mb']:>+8.1f} {'yes' if m['flat'] else 'no':>4}"
        )
    print(
        "drift = median RSS of the last quarter of the samples minus that of the first quarter"
        " (flat: under 10 MB)"
    )


def _print_targets(ctx: Context) -> None:
    rows = target_rows(ctx)
    print("\n-- the team's targets (printed, not asserted)")
    print(f"{'':<56} {'measured':>9} {'target':>14} met")
    for row in rows:
        if "value" in row:
            measured = f"{row['value']:.1f}"
            target = row["target"]
        else:
            measured = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            target = f">= {row['target']:g}" if row["target"] is not None else ""
        print(f"{row['what']:<56} {measured:>9} {target:>14} {_yes(row['met'])}")


def write_json(ctx: Context, path: str, targets: list[dict[str, Any]] | None = None) -> None:
    """Write the figures, `ctx.results` and the targets (default: `target_rows`) to `path`."""
    finish_figures(ctx)
    data = {
        "messages": ctx.n,
        "finished_at": datetime.now(UTC).isoformat(),
        "environment": ctx.environment,
        "figures": [f.as_dict() for f in ctx.figures.values()],
        **ctx.results,
        "targets": target_rows(ctx) if targets is None else targets,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
