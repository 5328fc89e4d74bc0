"""The summary ``radixd status`` prints: a ``/v1/stats`` document, as an operator reads it.

Pure formatting (no I/O, nothing of the daemon imported), apart from the command line so that the
commands' module stays about commands, and so that tests of a daemon's stats can render them.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["format_status"]


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


def _table(rows: list[list[str]], left: int = 1, indent: str = "  ") -> list[str]:
    """Aligned columns: the first ``left`` ones to the left, numbers to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i < left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def _tier_lines(tiers: dict[str, Any] | None, device_hits: int, page_size: int) -> list[str]:
    """A model's hits by tier and its host tier, from ``/v1/stats`` ``models.<m>.tiers``."""
    if tiers is None:
        return [f"  hits by tier: device {device_hits} tokens (no host tier)",
                "  host tier: off (host_pages = 0 or export_pools = false)"]
    l3_pages = int(tiers.get("l3_hit_pages", 0))
    out = [f"  hits by tier: device {device_hits}, host {tiers.get('loaded_tokens', 0)} tokens "
           f"(loaded back); L3 {l3_pages} pages ({l3_pages * page_size} tokens) fetched to host"]
    cap, used = int(tiers.get("host_pages_capacity", 0)), int(tiers.get("host_pages_used", 0))
    swa_cap = int(tiers.get("host_swa_pages_capacity", 0))
    swa = (f", swa {tiers.get('host_swa_pages_used', 0)}/{swa_cap}" if swa_cap else "")
    out.append(f"  host tier: full {used}/{cap} slots ({_pct(used, cap)}){swa}; "
               f"{tiers.get('backup_pages', 0)} pages copied to host, "
               f"{tiers.get('load_pages', 0)} loaded back; queue {tiers.get('backup_queue', 0)}"
               + (f"; {tiers['copy_errors']} copy errors" if tiers.get("copy_errors") else ""))
    return out


def _l3_line(l3: dict[str, Any] | None) -> str:
    """The Redis tier and its circuit breaker, from ``/v1/stats`` ``l3``."""
    if l3 is None:
        return "L3 (Redis): off (l3.url not set, or no model with a host tier uses it)"
    state = str(l3.get("breaker_state", "?"))
    return (f"L3 (Redis): breaker {state.upper() if state != 'closed' else state}; "
            f"hits {l3.get('hits', 0)} of {l3.get('gets', 0)} pages asked, "
            f"{l3.get('sets', 0)} written ({l3.get('set_failures', 0)} dropped); "
            f"{l3.get('timeouts', 0)} timeouts, {l3.get('errors', 0)} errors, "
            f"breaker opened {l3.get('breaker_opens', 0)} times")


def format_status(stats: dict[str, Any], url: str = "") -> str:
    """The human summary ``radixd status`` prints, from a /v1/stats document."""
    lines = []
    ready = "ready" if stats.get("ready") else "NOT READY"
    lines.append(f"radixd {stats.get('version', '?')}  instance {stats.get('instance', '?')}  "
                 f"up {_duration(float(stats.get('uptime_s', 0)))}  {ready}"
                 + (f"  ({url})" if url else ""))
    lines.append(f"sessions {stats.get('sessions', 0)}  operations {stats.get('ops_total', 0)}")
    wr = stats.get("warm_restart") or {}
    if wr.get("source") in ("state_dir", "fdstore"):
        lines.append(f"warm restart ({wr['source']}): kept {wr.get('kept_pages', 0)} host "
                     f"pages, dropped "
                     f"{wr.get('dropped_pages', 0)}, restored in "
                     f"{float(wr.get('restore_seconds', 0)):.3f} s")
    elif wr.get("reason"):
        lines.append(f"warm restart: saved state refused ({wr['reason']})")
    chk = stats.get("checker") or {}
    if chk.get("ok") is None:
        lines.append("last check: none yet")
    else:
        ago = _duration(max(0.0, time.time() - float(chk.get("at") or 0)))
        verdict = "ok" if chk["ok"] else f"{chk.get('violation_count', 0)} VIOLATION(S)"
        lines.append(f"last check: {verdict} ({chk.get('kind') or 'full'} check, {ago} ago)")
        for v in (chk.get("violations") or [])[:10]:
            lines.append(f"  - {v}")
    for name, m in (stats.get("models") or {}).items():
        lines.append("")
        window = m.get("sliding_window")
        lines.append(f"model {name}: page {m.get('page_size')} tokens, "
                     + (f"window {window} tokens, " if window else "no sliding window, ")
                     + f"policy {m.get('policy')}, {m.get('nodes', 0)} tree nodes")
        rows = [["pool", "used/capacity", "used", "free", "tree", "evictable", "locked", "held"]]
        for pool, p in (m.get("pools") or {}).items():
            cap = int(p.get("capacity", 0))
            used = cap - int(p.get("free", 0))
            rows.append([pool, f"{used}/{cap}", _pct(used, cap), str(p.get("free", 0)),
                         str(p.get("tree", 0)), str(p.get("evictable", 0)),
                         str(p.get("locked", 0)), str(p.get("held", 0))])
        lines += _table(rows)
        lines.append(f"  hits: {m.get('hit_tokens', 0) + m.get('host_hit_tokens', 0)} of "
                     f"{m.get('match_tokens', 0)} tokens ({100.0 * float(m.get('hit_rate', 0)):.1f}"
                     f"%, device and host) in {m.get('matches', 0)} requests")
        lines += _tier_lines(m.get("tiers"), int(m.get("hit_tokens", 0)),
                             int(m.get("page_size") or 0))
        ev = {r: v for r, v in (m.get("evictions") or {}).items()
              if v.get("full") or v.get("swa")}
        if ev:
            lines.append("  evicted pages (full/swa): " + ", ".join(
                f"{r} {v.get('full', 0)}/{v.get('swa', 0)}" for r, v in ev.items()))
        else:
            lines.append("  evicted pages: none")
    lines.append("")
    lines.append(_l3_line(stats.get("l3")))
    tenants = stats.get("tenants") or []
    if tenants:
        lines.append("")
        lines.append("tenants:")
        rows = [["name", "namespace", "sessions", "hit rate", "hit/match tokens",
                 "quota refusals"]]
        for t in tenants:
            hits = t.get("hit_tokens", 0) + t.get("host_hit_tokens", 0)
            rows.append([str(t.get("name")), str(t.get("namespace")), str(t.get("sessions", 0)),
                         f"{100.0 * float(t.get('hit_rate', 0)):.1f}%",
                         f"{hits}/{t.get('match_tokens', 0)}",
                         str(t.get("quota_refusals", 0))])
        lines += _table(rows, left=2)
    return "\n".join(lines)
