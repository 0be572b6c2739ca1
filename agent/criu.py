"""Finding criu and finding out what it can do on this kernel."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys

from revenant.agent import procs
from revenant.common.errors import CriuError
from revenant.messages import CriuInfo

MIN_VERSION = (4, 1)
# Features revenant decides on: soft-dirty tracking gates incremental dumps and
# pre-dump; the rest are reported so operators see what the kernel offers.
FEATURES = ("mem_dirty_track", "uffd-noncoop", "pidfd_store", "clone3_set_tid", "timens")

_VERSION_RE = re.compile(r"^Version:\s*(\S+)", re.M)


def locate_criu(configured: str = "", environ: dict[str, str] | None = None) -> str:
    """criu from config, then ``$REVENANT_CRIU``, then this environment's bin/, then PATH."""
    env = os.environ if environ is None else environ
    for source, value in (("criu_path", configured), ("REVENANT_CRIU", env.get("REVENANT_CRIU", ""))):
        if value:
            if not (os.path.isfile(value) and os.access(value, os.X_OK)):
                raise CriuError(f"criu not found: {source}={value} is not an executable file")
            return value
    venv_criu = os.path.join(os.path.dirname(sys.executable), "criu")
    if os.access(venv_criu, os.X_OK):
        return venv_criu
    found = shutil.which("criu", path=env.get("PATH", os.defpath))
    if found:
        return found
    raise CriuError("criu not found: set criu_path, REVENANT_CRIU, or put criu on PATH (make setup installs it)")


def last_error_line(output: str) -> str:
    """criu's most telling line: the last error that is not the harmless RLIMIT_NOFILE one."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    if errors:
        return errors[-1]
    rest = [ln for ln in lines if "RLIMIT_NOFILE" not in ln]
    return rest[-1] if rest else "(no output)"


def parse_version(text: str) -> str | None:
    m = _VERSION_RE.search(text)
    return m.group(1) if m else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


async def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    try:
        done = await procs.run(argv, timeout_s)
    except asyncio.TimeoutError:
        raise CriuError(f"{' '.join(argv[1:])} timed out after {timeout_s:g} s") from None
    return done.returncode, done.output


async def inspect_criu(configured: str = "", timeout_s: float = 30.0) -> CriuInfo:
    """Locate criu and run ``--version``, ``check`` and ``check --feature``; never raises."""
    try:
        path = locate_criu(configured)
    except CriuError as exc:
        return CriuInfo(ok=False, error=str(exc))
    try:
        rc, out = await _run([path, "--version"], timeout_s)
        version = parse_version(out)
        if rc != 0:
            return CriuInfo(path=path, ok=False, error=f"criu --version failed: {last_error_line(out)}")
        if version is None:
            return CriuInfo(path=path, ok=False, error=f"{path} is not criu: no 'Version:' in its --version output")
        if version_tuple(version) < MIN_VERSION:
            need = ".".join(map(str, MIN_VERSION))
            return CriuInfo(path=path, version=version, ok=False,
                            error=f"criu {version} is too old: revenant needs {need} or later")
        rc, out = await _run([path, "check"], timeout_s)
        results = await asyncio.gather(*(_run([path, "check", "--feature", f], timeout_s) for f in FEATURES))
    except (OSError, CriuError) as exc:
        return CriuInfo(path=path, ok=False, error=f"cannot run criu: {exc}")
    features = {name: code == 0 for name, (code, _) in zip(FEATURES, results)}
    if rc != 0:
        return CriuInfo(path=path, version=version, ok=False, features=features,
                        error=f"criu check failed: {last_error_line(out)}")
    return CriuInfo(path=path, version=version, ok=True, features=features)
