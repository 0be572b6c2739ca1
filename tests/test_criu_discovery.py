"""Finding criu and reading its output, pure: no criu is run."""

from __future__ import annotations

import pytest

from revenant.agent.pipeline.criu import error_line, locate_criu, parse_version
from revenant.common.errors import CriuError

pytestmark = pytest.mark.unit


def test_the_error_line_skips_the_harmless_rlimit_error():
    out = ("(00.001) Error (criu/util.c:123): rlimit: Can't setup RLIMIT_NOFILE\n"
           "(00.200) Error (criu/cr-dump.c:99): Dumping FAILED.\n"
           "(00.201) Error (criu/util.c:123): rlimit: Can't setup RLIMIT_NOFILE\n")
    assert error_line(out) == "(00.200) Error (criu/cr-dump.c:99): Dumping FAILED."
    assert error_line("Looks good.\n") == "Looks good."
    assert parse_version("Version: 4.1.1\nGitID: x\n") == "4.1.1"


def test_locate_criu_order(tmp_path):
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert locate_criu(str(fake), environ={}) == str(fake)
    assert locate_criu("", environ={"REVENANT_CRIU": str(fake)}) == str(fake)
    with pytest.raises(CriuError, match="criu_path=/nope"):
        locate_criu("/nope", environ={})
    with pytest.raises(CriuError, match="REVENANT_CRIU=/nope"):
        locate_criu("", environ={"REVENANT_CRIU": "/nope"})
