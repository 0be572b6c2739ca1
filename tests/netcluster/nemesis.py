"""The nemesis: cuts, drops and slows links between the namespaces of a ``revenant up --netns``
cluster, and logs every change with its time.

Each namespace gets one nftables table, ``inet revenant_nemesis``, with an ``output`` and an
``input`` chain; the nemesis keeps the rules it wants for every namespace and replaces the
whole table at once (``nft -f``) on each change.  A link from A to B is cut in A's output
(``ip daddr B``) and in B's input (``ip saddr A``): either alone would do, both make a cut
hold even if one side's table is replaced.  Loss is ``numgen random mod 100 < P``.  Delay is
``tc qdisc netem`` on the namespace's interface, where the kernel has netem
(``delay_supported``).  ``heal`` empties every table.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

TABLE = "revenant_nemesis"
NETNS_DIR = Path("/run/netns")


class NemesisError(Exception):
    pass


def _in(netns: str, argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
    proc = subprocess.run([nsenter, f"--net={NETNS_DIR / netns}", "--", *argv], input=stdin, capture_output=True,
                          text=True, timeout=30)
    if check and proc.returncode != 0:
        line = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise NemesisError(f"{' '.join(argv[:2])} in {netns}: {line}")
    return proc


class Nemesis:
    """``members``: name -> (netns, address), as cluster.json's ``netns.members`` has them."""

    def __init__(self, members: dict[str, dict], log_path: Path | None = None) -> None:
        self.members = {name: (m["netns"], m["address"]) for name, m in members.items()}
        self.log_path = log_path
        self.log: list[dict] = []
        # (src, dst) -> percent of packets dropped (100: cut)
        self.drops: dict[tuple[str, str], int] = {}
        self.delays: dict[str, int] = {}
        self._lock = threading.Lock()
        self._flapping: list[threading.Thread] = []
        self._stop_flap = threading.Event()
        if not shutil.which("nft"):
            raise NemesisError("the nemesis needs nft (Debian package nftables)")

    # What it does -------------------------------------------------------------------------

    def partition(self, side_a: list[str], side_b: list[str]) -> None:
        """Cut every link between ``side_a`` and ``side_b``, both ways."""
        with self._lock:
            for a in side_a:
                for b in side_b:
                    self.drops[(a, b)] = self.drops[(b, a)] = 100
            self._apply("partition", a=side_a, b=side_b)

    def isolate(self, name: str) -> None:
        """Cut ``name`` from everyone."""
        self.partition([name], [m for m in self.members if m != name])

    def drop(self, src: str, dst: str, percent: int = 100) -> None:
        """Drop ``percent`` of the packets from ``src`` to ``dst`` (one way)."""
        with self._lock:
            self.drops[(src, dst)] = percent
            self._apply("drop", src=src, dst=dst, percent=percent)

    def delay(self, name: str, ms: int) -> None:
        """Delay every packet ``name`` sends by ``ms`` (tc netem)."""
        if not delay_supported():
            raise NemesisError("this kernel has no netem qdisc (sch_netem): delay cannot be added here")
        with self._lock:
            self.delays[name] = ms
            netns = self.members[name][0]
            _in(netns, ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms"])
            self._record("delay", name=name, ms=ms)

    def heal(self) -> None:
        """Undo everything: every link whole again."""
        self.stop_flapping()
        with self._lock:
            self.drops.clear()
            for name in list(self.delays):
                _in(self.members[name][0], ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
            self.delays.clear()
            self._apply("heal")

    def flap(self, side_a: list[str], side_b: list[str], period_s: float, duration_s: float) -> threading.Thread:
        """Cut and mend the links between the two sides every ``period_s`` for ``duration_s``."""
        def run() -> None:
            end = time.monotonic() + duration_s
            cut = False
            while time.monotonic() < end and not self._stop_flap.is_set():
                with self._lock:
                    for a in side_a:
                        for b in side_b:
                            if cut:
                                self.drops.pop((a, b), None)
                                self.drops.pop((b, a), None)
                            else:
                                self.drops[(a, b)] = self.drops[(b, a)] = 100
                    cut = not cut
                    self._apply("flap-cut" if cut else "flap-mend", a=side_a, b=side_b)
                self._stop_flap.wait(period_s)
        thread = threading.Thread(target=run, name="nemesis-flap", daemon=True)
        self._stop_flap.clear()
        thread.start()
        self._flapping.append(thread)
        return thread

    def stop_flapping(self) -> None:
        self._stop_flap.set()
        for thread in self._flapping:
            thread.join(timeout=10)
        self._flapping.clear()

    # How ----------------------------------------------------------------------------------

    def _apply(self, what: str, **detail: object) -> None:
        """Replace every namespace's table with the rules ``drops`` asks for."""
        rules: dict[str, list[str]] = defaultdict(list)
        for (src, dst), percent in sorted(self.drops.items()):
            match = "drop" if percent >= 100 else f"numgen random mod 100 < {percent} drop"
            rules[(src, "output")].append(f"ip daddr {self.members[dst][1]} {match}")
            if percent >= 100:
                rules[(dst, "input")].append(f"ip saddr {self.members[src][1]} {match}")
        for name, (netns, _) in self.members.items():
            chains = "".join(
                f"  chain {hook} {{\n    type filter hook {hook} priority -10; policy accept;\n"
                + "".join(f"    {r}\n" for r in rules.get((name, hook), ())) + "  }\n"
                for hook in ("output", "input"))
            script = f"table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n{chains}}}\n"
            _in(netns, ["nft", "-f", "-"], stdin=script)
        self._record(what, **detail)

    def _record(self, what: str, **detail: object) -> None:
        entry = {"t": time.time(), "what": what, **detail}
        self.log.append(entry)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")


_DELAY: bool | None = None


def delay_supported() -> bool:
    """Whether this kernel has the netem qdisc (tried once, in a namespace of its own)."""
    global _DELAY
    if _DELAY is None:
        probe = f"rv-netem-probe-{threading.get_ident() % 100000}"
        subprocess.run(["ip", "netns", "add", probe], capture_output=True)
        try:
            _DELAY = _in(probe, ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                         check=False).returncode == 0
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return _DELAY
