"""The report of a multi-turn run: per round and in total, as JSON, as text, as a PNG.

Hit accounting, per request: ``device`` = the ``prefix_len`` of the first ``match`` (KV already
in the device pool and usable); ``host`` + ``l3`` = what ``load`` added to it (its
``prefix_len`` minus the match's), split by where it was before the request: ``l3`` is the part
that ``prefetch`` had just brought from Redis into L2, ``host`` the rest. That added part is the
``loaded_len`` copied from L2, plus device-resident full KV that only became usable because the
load restored its SWA window from L2 (both are hits thanks to the host tier; the raw
``loaded_len`` is kept in every request's record). ``device + host + l3`` is the usable prefix
the request started its prefill from. The ideal is what an infinite cache would hit: for round
r >= 1, the previous prompt plus the committed part of its output, page-aligned
(:class:`~radixd_bench.workload.Workload`, the same formula the in-process replay is checked
against).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .options import Options

__all__ = ["build_report", "format_report", "plot_available", "write_json", "write_plot"]


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _summary(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_len"] for r in recs)
    device = sum(r["device_hit"] for r in recs)
    host = sum(r["host_hit"] for r in recs)
    l3 = sum(r["l3_hit"] for r in recs)
    ttfts = sorted(r["ttft_s"] for r in recs if r["ttft_s"] is not None)

    def pct(q: float) -> float | None:
        if not ttfts:
            return None
        return ttfts[min(len(ttfts) - 1, max(0, math.ceil(q * len(ttfts)) - 1))]

    return {
        "requests": len(recs),
        "failed": sum(1 for r in recs if r["failed"]),
        "prompt_tokens": prompt,
        "hit_tokens": device + host + l3,
        "device_hit_tokens": device,
        "host_hit_tokens": host,
        "l3_hit_tokens": l3,
        "prefill_tokens": sum(r["prefill_tokens"] for r in recs),
        "output_tokens": sum(r["output_len"] for r in recs),
        "hit_rate": _ratio(device + host + l3, prompt),
        "device_hit_rate": _ratio(device, prompt),
        "host_hit_rate": _ratio(host, prompt),
        "l3_hit_rate": _ratio(l3, prompt),
        "swa_freed_tokens": sum(r["swa_freed_tokens"] for r in recs),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": pct(0.5),
        "ttft_p90_s": pct(0.9),
        "ttft_max_s": ttfts[-1] if ttfts else None,
    }


def build_report(opts: Options, seed: int, model: str, info: Any, instance: str, wl: Any,
                 records: list[dict[str, Any]], samples: list[tuple[float, int, int]],
                 started: float, wall: float) -> dict[str, Any]:
    """The JSON-able report of a finished run (``records``: one per request)."""
    P = info.page_size
    records.sort(key=lambda r: (r["round"], r["start"]))
    rounds = []
    for r in range(opts.rounds):
        recs = [x for x in records if x["round"] == r]
        s = _summary(recs)
        ideal = 0.0
        if r:
            ideal = (wl.prompt_len(r - 1) + opts.output - 1) // P * P / wl.prompt_len(r)
        s.update(round=r, ideal_hit_rate=ideal,
                 wall_s=(max(x["end"] for x in recs) - min(x["start"] for x in recs))
                 if recs else 0.0)
        rounds.append(s)
    total = _summary(records)
    total["ideal_hit_rate"] = wl.ideal_hit_rate()
    full_cap = info.full_pages - 1
    swa_cap = info.swa_pages - 1 if info.swa_pages else 0
    peak_full = max((s[1] for s in samples), default=0)
    peak_swa = max((s[2] for s in samples), default=0)
    for rec in records:
        rec["start"] = round(rec["start"] - started, 6)
        rec["end"] = round(rec["end"] - started, 6)
    options = asdict(opts)
    options.pop("token", None)  # never written out
    options["seed"] = seed
    if math.isinf(options["request_rate"]):
        options["request_rate"] = None  # JSON has no infinity: null means "no gaps"
    return {
        "format": 1,
        "daemon_instance": instance,
        "model": model,
        "page_size": P,
        "sliding_window": info.sliding_window if info.swa_pages else None,
        "options": options,
        "working_set_pages": wl.working_set_pages(),
        "wall_s": wall,
        "total": total,
        "rounds": rounds,
        "pool": {
            "source": f"stats operation (tree + session-held pages of the tenant's namespace), "
                      f"polled every {opts.sample_interval_s:g} s and at every request's end "
                      "from a separate session",
            "full_capacity": full_cap,
            "swa_capacity": swa_cap,
            "peak_full_pages": peak_full,
            "peak_swa_pages": peak_swa,
            "peak_full_usage": _ratio(peak_full, full_cap),
            "peak_swa_usage": _ratio(peak_swa, swa_cap),
            "samples": len(samples),
        },
        "timeline": {
            "t_s": [round(t - started, 6) for t, _, _ in samples],
            "full_pages": [f for _, f, _ in samples],
            "swa_pages": [s for _, _, s in samples],
        },
        "requests": records,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def format_report(report: dict[str, Any]) -> str:
    """The human summary: one row per round, the totals, the pool peaks."""
    o = report["options"]
    head = (f"multi-turn on model {report['model']} (page {report['page_size']}, window "
            f"{report['sliding_window'] or '-'}), engine {o['engine']}"
            f"{', L3 prefetch' if o['l3'] else ''}: {o['clients']} clients x {o['rounds']} "
            f"rounds, first prompt {o['first_prompt']}, output {o['output']}, sub-question "
            f"{o['subq']}, seed {o['seed']}")
    rows = [["round", "reqs", "failed", "prompt tok", "hit", "device", "host", "l3", "ideal",
             "ttft p50 ms", "ttft max ms"]]

    def row(name: str, s: dict[str, Any], ideal: float) -> list[str]:
        return [name, str(s["requests"]), str(s["failed"]), str(s["prompt_tokens"]),
                f"{s['hit_rate']:.3f}", f"{s['device_hit_rate']:.3f}",
                f"{s['host_hit_rate']:.3f}", f"{s['l3_hit_rate']:.3f}", f"{ideal:.3f}",
                _ms(s["ttft_p50_s"]), _ms(s["ttft_max_s"])]

    for s in report["rounds"]:
        rows.append(row(str(s["round"]), s, s["ideal_hit_rate"]))
    t = report["total"]
    rows.append(row("total", t, t["ideal_hit_rate"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0 or j == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    p = report["pool"]
    lines.append("")
    lines.append(f"peak device pool usage: full {p['peak_full_pages']}/{p['full_capacity']} "
                 f"pages ({100 * p['peak_full_usage']:.1f}%), SWA {p['peak_swa_pages']}/"
                 f"{p['swa_capacity']} pages ({100 * p['peak_swa_usage']:.1f}%); from the "
                 f"{p['source']}")
    lines.append(f"SWA KV freed early: {t['swa_freed_tokens']} tokens; prefill computed "
                 f"{t['prefill_tokens']} of {t['prompt_tokens']} prompt tokens; "
                 f"wall {report['wall_s']:.2f} s")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    """The report as one JSON document (the folder is created if needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")


def plot_available() -> str | None:
    """None when matplotlib can be imported, else why not (checked before a run, not after)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        return (f"--plot needs matplotlib ({exc}); install it with pip install "
                "'radixd[bench]'")
    return None


def write_plot(report: dict[str, Any], path: str) -> None:
    """A PNG: device pool usage over time (top) and hit rate over time (bottom), with the round
    boundaries; matplotlib is imported here only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl, p = report["timeline"], report["pool"]
    reqs = sorted(report["requests"], key=lambda r: r["end"])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    try:
        if p["full_capacity"]:
            ax1.plot(tl["t_s"], [100 * f / p["full_capacity"] for f in tl["full_pages"]],
                     label="full pool")
        if p["swa_capacity"]:
            ax1.plot(tl["t_s"], [100 * s / p["swa_capacity"] for s in tl["swa_pages"]],
                     label="SWA pool")
        ax1.set_ylabel("device pool used (%)")
        ax1.set_ylim(0, 105)
        ax1.legend(loc="lower right")
        ax1.grid(alpha=0.3)
        ax2.scatter([r["end"] for r in reqs],
                    [(r["device_hit"] + r["host_hit"] + r["l3_hit"]) / r["prompt_len"]
                     for r in reqs], marker="x", s=18, color="black", linewidths=0.8,
                    label="request (all tiers)")
        for key, label in (("device_hit", "from device"), ("host_hit", "from host (L2)"),
                           ("l3_hit", "from L3")):
            part = [r for r in reqs if r[key]]
            if part:
                ax2.scatter([r["end"] for r in part], [r[key] / r["prompt_len"] for r in part],
                            s=12, alpha=0.7, label=label)
        hit = prompt = 0
        cum = []
        for r in reqs:
            hit += r["device_hit"] + r["host_hit"] + r["l3_hit"]
            prompt += r["prompt_len"]
            cum.append(hit / prompt)
        ax2.plot([r["end"] for r in reqs], cum, color="black", label="cumulative hit rate")
        ax2.axhline(report["total"]["ideal_hit_rate"], color="grey", linestyle="--",
                    label="ideal (cumulative, end of run)")
        for rnd in report["rounds"][1:]:
            starts = [r["start"] for r in reqs if r["round"] == rnd["round"]]
            if starts:
                for ax in (ax1, ax2):
                    ax.axvline(min(starts), color="tab:red", alpha=0.5, linewidth=0.8,
                               linestyle=":")
                ax1.annotate(f"round {rnd['round']}", (min(starts), 1.0),
                             xycoords=("data", "axes fraction"), xytext=(2, -10),
                             textcoords="offset points", fontsize="x-small", color="tab:red")
        ax2.set_ylabel("hit rate (per request)")
        ax2.set_xlabel("seconds since the first request")
        ax2.set_ylim(0, 1.05)
        ax2.legend(loc="best", fontsize="small")
        ax2.grid(alpha=0.3)
        o = report["options"]
        fig.suptitle(f"radixd multi-turn: {report['model']}, {o['clients']} clients x "
                     f"{o['rounds']} rounds, engine {o['engine']}"
                     f"{', L3 prefetch' if o['l3'] else ''}")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
