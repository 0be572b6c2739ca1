"""bench/failover.py's restore modes: the agents' environment per mode, and the measures of a lazy
restore (T0 -> restore_completed, the restored job's slowdown while its pages arrive) and its targets.

Not a benchmark of its own: ``bench/failover.py --restore-mode eager,lazy`` runs it (see that file's
docstring for what each measure means).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

MiB = 1 << 20
WINDOW_S = 3.0               # the slowdown window after the restored job's first new line
MODES = ("eager", "lazy")
CACHES = ("warm", "cold")
LAZY_TARGET_RATIO = 1.3      # T0 -> restore_completed (lazy) / T0 -> restored (eager), medians
LAZY_TARGET_RESUMED_S = 3.5  # T0 -> printing again, lazy, cold images
LAZY_TARGET_SIZES = (1024, 4096)
MODE_ENV = "REVENANT_AGENT_RESTORE_MODE"

# (job, kinds, after) -> the first such job event arrived with ``at`` > after, or None
EventLookup = Callable[[str, tuple[str, ...], float], "dict | None"]


def rounded(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def agent_has_restore_mode() -> bool:
    """Whether this revenant's agent has a ``restore_mode`` setting (lazy restore)."""
    try:
        from revenant.common.settings.config import AgentConfig
    except ImportError:
        return False
    return "restore_mode" in AgentConfig.__struct_fields__


def up_env(mode: str) -> dict[str, str]:
    """The environment for ``revenant up`` (its agents inherit it) for one restore mode.  An agent
    without the setting restores eagerly and refuses the unknown variable, so eager sets none there."""
    env = {k: v for k, v in os.environ.items() if k != MODE_ENV}
    if agent_has_restore_mode():
        env[MODE_ENV] = mode
    elif mode != "eager":
        raise RuntimeError(f"this revenant's agent has no restore_mode setting, so no {mode} restore")
    return env


def ticks(text: str) -> list[dict]:
    """The workload's ``tick N WALL ok|CORRUPT`` lines."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "tick":
            try:
                out.append({"n": int(parts[1]), "wall": float(parts[2]), "check": parts[3]})
            except ValueError:
                continue
    return out


def gaps(walls: list[float]) -> list[float]:
    return [b - a for a, b in zip(walls, walls[1:])]


def gap_before(output: Path, since: float) -> dict:
    """The job's output lines stamped after ``since`` (the checkpoint) so far: their median gap."""
    before = [t for t in ticks(output.read_text(errors="replace")) if t["wall"] > since]
    return {"ticks_before_kill": len(before), "gap_before_p50_s": rounded(median(gaps([t["wall"] for t in before])), 4)}


def watch_output(output: Path, t0: float) -> tuple[dict | None, list[dict]]:
    """The restored job's first output line after T0, and its lines from there on until one stamped
    WINDOW_S or more after it (that one included)."""
    resumed = None
    new: list[dict] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = [t for t in ticks(output.read_text(errors="replace")) if t["wall"] > t0]
        if new and resumed is None:
            resumed = new[0]
            deadline = time.monotonic() + WINDOW_S + 10
        if resumed is not None and new[-1]["wall"] >= resumed["wall"] + WINDOW_S:
            break
        time.sleep(0.05)
    if resumed is None:
        return None, []
    end = next((i for i, t in enumerate(new) if t["wall"] >= resumed["wall"] + WINDOW_S), len(new) - 1)
    return resumed, new[:end + 1]


def expects_completion(mode: str, node2_lazy: bool | None) -> bool:
    """Whether a run should see restore_completed: lazy mode, unless node-2 says it cannot restore lazily."""
    return mode == "lazy" and node2_lazy is not False


def wait_completed(event: EventLookup, job: str, t0: float, timeout_s: float) -> None:
    """Wait for the job's restore_completed event (or an eviction) after T0, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while event(job, ("restore_completed", "evicted", "failed"), t0) is None and time.monotonic() < deadline:
        time.sleep(0.05)


def lazy_measures(r: dict, event: EventLookup, stream: list[dict], job: str, t0: float,
                  window: list[dict], mode: str) -> None:
    """T0 -> restore_completed and the slowdown window, into the run's result ``r``; a run that did
    not go as its mode should gets its status changed."""
    def in_stream(kinds: tuple[str, ...]) -> dict | None:
        return next((e for e in stream if e.get("job") == job and e.get("kind") in kinds
                     and e.get("at", 0) > t0), None)

    done = event(job, ("restore_completed",), t0) or in_stream(("restore_completed",))
    evicted = in_stream(("evicted", "failed")) or event(job, ("evicted", "failed"), t0)
    nbytes = done.get("bytes") if done else None
    done_s = done["at"] - t0 if done else None
    r.update({
        "restore_completed_s": rounded(done_s),
        "restore_completed_duration_s": done.get("duration_s") if done else None,
        "restore_completed_bytes": nbytes,
        "restore_completed_mib": rounded(nbytes / MiB, 1) if nbytes is not None else None,
        "restore_completed_epoch": done.get("epoch") if done else None,
        "restore_completed_after_restored_s": rounded(done_s - r["total_s"])
        if done_s is not None and r.get("total_s") is not None else None,
        "evicted_after_t0": {k: evicted.get(k) for k in ("kind", "at", "node", "epoch", "reason")}
        if evicted else None,
    })
    after = gaps([t["wall"] for t in window])
    before = r.get("gap_before_p50_s")
    p50 = median(after)
    top = max(after) if after else None
    r.update({
        "window_ticks": len(window),
        "window_corrupt": sum(1 for t in window if t["check"] != "ok"),
        "gap_after_p50_s": rounded(p50, 4),
        "gap_after_max_s": rounded(top, 4),
        "slowdown_p50_ratio": rounded(p50 / before, 2) if p50 is not None and before else None,
        "slowdown_max_ratio": rounded(top / before, 2) if top is not None and before else None,
    })
    if r["status"] != "restored":
        return
    if r["window_corrupt"]:
        r["status"] = "restored-corrupt"
    elif mode == "lazy" and evicted is not None and (done is None or evicted["at"] < done["at"]):
        r["status"] = "lazy-evicted"
    elif expects_completion(mode, r.get("node2_lazy_restore")) and done is None:
        r["status"] = "lazy-incomplete"


def lazy_over_eager(per: dict) -> dict:
    """Per size and cache state: median T0 -> restore_completed (lazy) / median T0 -> restored (eager)."""
    lazy = per["lazy"]["restore_completed_s"]["median"]
    eager = per["eager"]["total_s"]["median"]
    return {"lazy_restore_completed_s": lazy, "eager_total_s": eager,
            "ratio": rounded(lazy / eager, 3) if lazy is not None and eager else None, "target": LAZY_TARGET_RATIO}


def targets(summary: dict, sizes: list[int], caches: list[str], modes: list[str]) -> str:
    """The lazy-restore targets, one line each."""
    lines = []
    if "eager" in modes and "lazy" in modes:
        for mib in sizes:
            for cache in caches:
                x = summary[str(mib)][cache]["lazy_over_eager"]
                if x["ratio"] is None:
                    lines.append(f"- {mib} MiB, {cache}: lazy all pages in / eager restored: no data")
                    continue
                lines.append(f"- {mib} MiB, {cache}: lazy T0 → restore_completed {x['lazy_restore_completed_s']:.2f} s"
                             f" / eager T0 → restored {x['eager_total_s']:.2f} s = **{x['ratio']:.2f}** "
                             f"(target ≤ {LAZY_TARGET_RATIO}: {'met' if x['ratio'] <= LAZY_TARGET_RATIO else 'MISSED'})")
    if "lazy" in modes and "cold" in caches:
        for mib in sizes:
            if mib not in LAZY_TARGET_SIZES:
                continue
            s = summary[str(mib)]["cold"]["lazy"]
            d = s["resumed_s"]
            if d["median"] is None:
                lines.append(f"- {mib} MiB, cold, lazy: T0 → printing again: no data")
                continue
            lines.append(f"- {mib} MiB, cold, lazy: T0 → printing again {d['median']:.2f} s median, max "
                         f"{d['max']:.2f} s (target ≤ {LAZY_TARGET_RESUMED_S} s: met by "
                         f"{s['resumed_le_target']} / {s['restored']} runs)")
    return "\n".join(lines)
