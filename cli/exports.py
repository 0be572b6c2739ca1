"""What a job's environment is made of at ``revenant submit``: ``--export`` and ``--env``, as
sbatch has them (docs/cli.md).  Pure: the coordinator checks the result again
(common/settings/limits.py)."""

from __future__ import annotations

from typing import Mapping

from revenant.common.settings.limits import BadRequest, env_problem


def exported_env(export: str | None, pairs: list[str], environ: Mapping[str, str],
                 root: bool) -> tuple[dict[str, str], list[str]]:
    """The job's environment from ``--export`` (``ALL`` by default, as sbatch; ``NONE``; ``NAME``s
    and ``NAME=VALUE``s, after ``ALL`` if it is listed) and ``--env NAME=VALUE``s, over
    ``environ``; and the names ``ALL`` left out because no job may get them (:func:`env_problem`).
    REVENANT_* (this client's own settings, its credential) are never exported by ``ALL``."""
    items = [item for item in (export if export is not None else "ALL").split(",") if item]
    words = [item.upper() for item in items if "=" not in item]
    if "NONE" in words and len(items) > 1:
        raise BadRequest("--export NONE stands alone; to pass a few variables, list them: --export NAME,NAME=VALUE")
    env: dict[str, str] = {}
    dropped: list[str] = []
    if "ALL" in words:
        for name, value in environ.items():
            if name.startswith("REVENANT_"):
                continue
            if env_problem(name, value, root) is not None:
                dropped.append(name)
            else:
                env[name] = value
    for item in items:
        if item.upper() in ("ALL", "NONE"):
            continue
        name, eq, value = item.partition("=")
        if not eq:
            if name not in environ:
                raise BadRequest(f"--export {name}: it is not set in this environment (give {name}=VALUE)")
            value = environ[name]
        env[name] = value
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise BadRequest(f"--env takes NAME=VALUE, got {pair[:80]!r}")
        env[name] = value
    return env, dropped
