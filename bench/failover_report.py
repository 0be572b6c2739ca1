"""bench/failover.py's report: medians per size, cache state, mode and server count, the table and
the ratios against the goals.
"""

from __future__ import annotations

# bench/ is not a package: these are this script's own directory's.
from failover_cluster import SERVERS_GOAL_RATIO, MiB, median, minus, rounded
from failover_lazy import LAZY_TARGET_RESUMED_S, WINDOW_S, lazy_over_eager

# ====================================================================== report

ROWS = [  # label, key, format of one number
    ("detection: T0 → dead event", "detection_s", ".2f"),
    ("  node's silence at the dead event", "dead_silence_s", ".2f"),
    ("  kill after node-1's last heartbeat", "kill_after_last_heartbeat_s", ".2f"),
    ("decision: dead event → restore request", "decision_s", ".2f"),
    ("  lease wait (coordinator log)", "lease_wait_logged_s", ".2f"),
    ("restore: restore request → restored event", "restore_s", ".2f"),
    ("  verify + rollback (request → criu start)", "restore_verify_s", ".2f"),
    ("  criu restore (criu start → agent's log line)", "restore_criu_s", ".2f"),
    ("  reply + job record (agent's log → restored)", "restore_after_agent_s", ".2f"),
    ("  read from the storage's disk before the job runs (MiB)", "restore_read_before_run_mib", ".1f"),
    ("**total: T0 → restored event (job runs)**", "total_s", ".2f"),
    ("restored event's since_last_heartbeat_s", "restored_since_last_heartbeat_s", ".2f"),
    ("last heartbeat → restore request", "heartbeat_to_restore_request_s", ".2f"),
    ("**job prints again: T0 → first new line**", "resumed_s", ".2f"),
    ("total − restore (goal ≤ 3 s)", "total_minus_restore_s", ".2f"),
    ("**all pages in: T0 → restore_completed**", "restore_completed_s", ".2f"),
    ("  its duration_s (restore start → last page)", "restore_completed_duration_s", ".2f"),
    ("  its bytes (MiB)", "restore_completed_mib", ".0f"),
    ("output gap before the kill, median", "gap_before_p50_s", ".3f"),
    (f"output gap, first {WINDOW_S:g} s printing again: p50", "gap_after_p50_s", ".3f"),
    ("  max", "gap_after_max_s", ".3f"),
    ("  slowdown p50 (after / before)", "slowdown_p50_ratio", ".2f"),
    ("  slowdown max (after / before)", "slowdown_max_ratio", ".2f"),
]


def _stats(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    return {"median": rounded(median(xs), 4), "min": rounded(min(xs), 4) if xs else None,
            "max": rounded(max(xs), 4) if xs else None, "n": len(xs)}


def _summarize_one(mine: list[dict]) -> dict:
    ok = [r for r in mine if r["status"] == "restored"]
    for r in ok:
        r["total_minus_restore_s"] = rounded(minus(r.get("total_s"), r.get("restore_s")))
    s: dict = {"attempts": len(mine), "restored": len(ok),
               "failed": [{"attempt": r["attempt"], "status": r["status"], "error": r.get("error")}
                          for r in mine if r["status"] != "restored"]}
    for _, key, _ in ROWS:
        s[key] = _stats([r.get(key) for r in ok])
    s["goal_total_le_3s_plus_restore"] = sum(1 for r in ok if r.get("goal_total_le_3s_plus_restore"))
    s["goal_heartbeat_to_restore_le_3s"] = sum(1 for r in ok if r.get("goal_heartbeat_to_restore_le_3s"))
    s["epoch_mib"] = rounded(median([r["epoch_bytes"] / MiB for r in ok if r.get("epoch_bytes")]), 1)
    s["node2_lazy_restore"] = sum(1 for r in ok if r.get("node2_lazy_restore"))
    s["resumed_le_target"] = sum(1 for r in ok if r.get("resumed_s") is not None
                                 and r["resumed_s"] <= LAZY_TARGET_RESUMED_S)
    return s


def summarize(runs: list[dict], sizes: list[int], caches: list[str], modes: list[str], servers: int = 1,
              auth: str | None = None) -> dict:
    """{size: {cache: {mode: stats, "lazy_over_eager": ...}}}, over the runs on ``servers`` nats-servers
    (and, given ``auth``, on clusters of that side only: secure or insecure)."""
    out: dict = {}
    runs = [r for r in runs if r.get("nats_servers", 1) == servers and auth in (None, r.get("auth", "secure"))]
    for mib in sizes:
        out[str(mib)] = {}
        for cache in caches:
            per = {mode: _summarize_one([r for r in runs if r["size_mib"] == mib and r.get("cache", "warm") == cache
                                         and r.get("restore_mode", "eager") == mode]) for mode in modes}
            if "eager" in per and "lazy" in per:
                per["lazy_over_eager"] = lazy_over_eager(per)
            out[str(mib)][cache] = per
    return out


def servers_ratio(by_servers: dict, sizes: list[int], caches: list[str], modes: list[str]) -> dict:
    """{size: {cache: {mode: {N: ...}}}}: per N > 1 nats-servers, the median total (T0 -> restored) on N
    servers over that on one, against SERVERS_GOAL_RATIO.  Empty unless 1 and another count ran."""
    counts = [int(n) for n in by_servers if int(n) != 1]
    if "1" not in by_servers or not counts:
        return {}
    out: dict = {}
    for mib in sizes:
        for cache in caches:
            for mode in modes:
                one = by_servers["1"][str(mib)][cache][mode]["total_s"]["median"]
                for n in counts:
                    many = by_servers[str(n)][str(mib)][cache][mode]["total_s"]["median"]
                    ratio = rounded(many / one, 3) if many is not None and one else None
                    out.setdefault(str(mib), {}).setdefault(cache, {}).setdefault(mode, {})[str(n)] = {
                        "total_s_1_server": one, f"total_s_{n}_servers": many, "ratio": ratio,
                        "goal": SERVERS_GOAL_RATIO, "met": None if ratio is None else ratio <= SERVERS_GOAL_RATIO}
    return out


def table(by_servers: dict, mib: int, caches: list[str], modes: list[str], ratios: dict | None = None) -> str:
    """One column per cache state, mode and nats-server count (the counts side by side)."""
    counts = [int(n) for n in by_servers]
    cols = [(c, m, n) for c in caches for m in modes for n in counts]

    def head(c: str, m: str, n: int) -> str:
        return f"{c} {m}" if len(counts) == 1 else f"{c} {m}, {n} server{'s' if n > 1 else ''}"

    def cell(d: dict, fmt: str) -> str:
        if d["median"] is None:
            return "–"
        return f"{d['median']:{fmt}} [{d['min']:{fmt}}–{d['max']:{fmt}}]"

    def row(label: str, f) -> str:
        return f"| {label} | " + " | ".join(f(by_servers[str(n)][str(mib)][c][m]) for c, m, n in cols) + " |"

    def ratio(c: str, m: str, n: int) -> str:
        x = (ratios or {}).get(str(mib), {}).get(c, {}).get(m, {}).get(str(n))
        if x is None:
            return "–"
        if x["ratio"] is None:
            return "no data"
        return f"**{x['ratio']:.2f}** ({'met' if x['met'] else 'not met'})"

    lines = [f"| {mib} MiB job: seconds, median [min–max] | " + " | ".join(head(*col) for col in cols) + " |",
             "|---|" + "---|" * len(cols),
             "| NATS servers | " + " | ".join(str(n) for _, _, n in cols) + " |",
             row("runs restored / attempts", lambda s: f"{s['restored']} / {s['attempts']}"),
             row("node-2 restores lazily (capability)", lambda s: f"{s['node2_lazy_restore']} / {s['restored']}"),
             row("checkpoint image (MiB)", lambda s: "–" if s["epoch_mib"] is None else f"{s['epoch_mib']:.0f}")]
    for label, key, fmt in ROWS:
        lines.append(row(label, lambda s, key=key, fmt=fmt: cell(s[key], fmt)))
    lines.append(row("runs meeting total ≤ 3 s + restore",
                     lambda s: f"{s['goal_total_le_3s_plus_restore']} / {s['restored']}"))
    lines.append(row("runs with last heartbeat → restore ≤ 3 s",
                     lambda s: f"{s['goal_heartbeat_to_restore_le_3s']} / {s['restored']}"))
    if ratios:
        lines.append(f"| **total on N servers / on 1 (goal ≤ {SERVERS_GOAL_RATIO:g})** | "
                     + " | ".join(ratio(*col) for col in cols) + " |")
    return "\n".join(lines)


def servers_lines(ratios: dict) -> str:
    """The NATS-cluster goal, one line per size, cache state, mode and server count."""
    lines = []
    for mib, per_size in ratios.items():
        for cache, per_cache in per_size.items():
            for mode, per_mode in per_cache.items():
                for n, x in per_mode.items():
                    if x["ratio"] is None:
                        lines.append(f"- {mib} MiB, {cache}, {mode}: total on {n} servers / on 1: no data")
                        continue
                    lines.append(f"- {mib} MiB, {cache}, {mode}: T0 → restored on {n} servers "
                                 f"{x[f'total_s_{n}_servers']:.2f} s / on 1 {x['total_s_1_server']:.2f} s = "
                                 f"**{x['ratio']:.2f}** (goal ≤ {SERVERS_GOAL_RATIO:g}: "
                                 f"{'met' if x['met'] else 'not met'})")
    return "\n".join(lines)


# ====================================================================== authenticated against --insecure

AUTH_WITHIN = 0.05
AUTH_PARTS = ["detection_s", "decision_s", "restore_s", "restore_verify_s", "restore_criu_s", "restore_after_agent_s",
              "total_s", "heartbeat_to_restore_request_s", "resumed_s"]


def auth_ratio(by_auth: dict, sizes: list[int], caches: list[str], modes: list[str]) -> dict:
    """{size: {cache: {mode: {part: {secure, insecure, ratio, within}}}}}: the medians of each part on
    authenticated clusters over those on --insecure ones (within AUTH_WITHIN or not)."""
    out: dict = {}
    if "secure" not in by_auth or "insecure" not in by_auth:
        return out
    for mib in sizes:
        for cache in caches:
            for mode in modes:
                sec = by_auth["secure"][str(mib)][cache][mode]
                ins = by_auth["insecure"][str(mib)][cache][mode]
                parts = {}
                for key in AUTH_PARTS:
                    a, b = sec[key]["median"], ins[key]["median"]
                    ratio = rounded(a / b, 3) if a is not None and b else None
                    parts[key] = {"secure": a, "insecure": b, "ratio": ratio,
                                  "difference_s": rounded(minus(a, b), 3),
                                  "within": None if ratio is None else abs(ratio - 1) <= AUTH_WITHIN}
                out.setdefault(str(mib), {}).setdefault(cache, {})[mode] = parts
    return out


def auth_table(by_auth: dict, mib: int, caches: list[str], modes: list[str], ratios: dict) -> str:
    """One column per cache state, mode and side (secure, insecure); then secure / insecure per part."""
    sides = [a for a in ("secure", "insecure") if a in by_auth]
    cols = [(c, m, a) for c in caches for m in modes for a in sides]

    def cell(d: dict, fmt: str) -> str:
        if d["median"] is None:
            return "–"
        return f"{d['median']:{fmt}} [{d['min']:{fmt}}–{d['max']:{fmt}}]"

    def row(label: str, f) -> str:
        return f"| {label} | " + " | ".join(f(by_auth[a][str(mib)][c][m]) for c, m, a in cols) + " |"

    lines = [f"| {mib} MiB job: seconds, median [min–max] | " + " | ".join(f"{c} {m}, {a}" for c, m, a in cols) + " |",
             "|---|" + "---|" * len(cols),
             row("runs restored / attempts", lambda s: f"{s['restored']} / {s['attempts']}")]
    for label, key, fmt in ROWS:
        if key in AUTH_PARTS or key in ("dead_silence_s", "kill_after_last_heartbeat_s", "lease_wait_logged_s"):
            lines.append(row(label, lambda s, key=key, fmt=fmt: cell(s[key], fmt)))
    labels = {key: label for label, key, _ in ROWS}
    out = ["\n".join(lines), "",
           f"| {mib} MiB: secure / insecure (medians) | " + " | ".join(f"{c} {m}" for c in caches for m in modes) + " |",
           "|---|" + "---|" * (len(caches) * len(modes))]
    for key in AUTH_PARTS:
        cells = []
        for c in caches:
            for m in modes:
                x = ratios.get(str(mib), {}).get(c, {}).get(m, {}).get(key)
                if x is None or x["ratio"] is None:
                    cells.append("–")
                else:
                    cells.append(f"{x['ratio']:.3f} ({x['difference_s']:+.3f} s){'' if x['within'] else ' > 5 %'}")
        out.append(f"| {labels[key].strip()} | " + " | ".join(cells) + " |")
    return "\n".join(out)
