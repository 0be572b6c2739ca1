"""`criu check` as the agent runs it (inspect_criu): the real criu, and stand-ins that are too old or fail."""

from __future__ import annotations

import pytest

from revenant.agent.pipeline.criu import inspect_criu

pytestmark = pytest.mark.criu


async def test_real_criu_passes_check_and_reports_features():
    info = await inspect_criu()
    assert info.ok, info.error
    assert tuple(int(x) for x in info.version.split(".")[:2]) >= (4, 1)
    assert set(info.features) >= {"mem_dirty_track"}
    assert all(isinstance(v, bool) for v in info.features.values())


async def test_too_old_or_failing_criu_is_reported_with_its_own_line(tmp_path):
    old = tmp_path / "old-criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    info = await inspect_criu(str(old))
    assert not info.ok and "3.17.1 is too old" in info.error
    broken = tmp_path / "broken-criu"
    broken.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "Version: 4.1.1"; exit 0; fi\n'
                      'echo "Error (criu/util.c:1): rlimit: Can\'t setup RLIMIT_NOFILE"\n'
                      'echo "Error (criu/vdso.c:2): vdso: Unexpected rt vDSO area bounds"\nexit 1\n')
    broken.chmod(0o755)
    info = await inspect_criu(str(broken))
    assert not info.ok
    assert info.error == "criu check failed: Error (criu/vdso.c:2): vdso: Unexpected rt vDSO area bounds"
