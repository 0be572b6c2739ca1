"""Config loading: file, environment and overrides in layers, one clear error per mistake,
and docs/configuration.md in step with the defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from revenant.common.config import AgentConfig, CoordinatorConfig, load_config
from revenant.common.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def test_config_file_env_and_overrides_layer(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[coordinator]\nnode_timeout_s = 4.0\nsuspect_timeout_s = 2.0\n[agent]\nnode = "a"\n')
    cfg = load_config(CoordinatorConfig, "coordinator", f, {"probe_timeout_s": 0.3},
                      environ={"REVENANT_COORDINATOR_SUSPECT_TIMEOUT_S": "3"})
    assert (cfg.node_timeout_s, cfg.suspect_timeout_s, cfg.probe_timeout_s) == (4.0, 3.0, 0.3)
    assert load_config(AgentConfig, "agent", f, environ={}).node == "a"


@pytest.mark.parametrize(
    "toml, env, message",
    [
        ("[coordinator]\nnode_timout_s = 4\n", {}, "node_timout_s"),
        ("[coordinator]\nnode_timeout_s = 'soon'\n", {}, "node_timeout_s"),
        ("[coordinator]\nnode_timeout_s = 1.0\n", {}, "at least suspect_timeout_s"),
        ("", {"REVENANT_COORDINATOR_NODE_TIMEOUTS": "1"}, "REVENANT_COORDINATOR_NODE_TIMEOUTS"),
        ("[coordinator\n", {}, "r.toml"),
        ("coordinator = 3\n", {}, "must be a table"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, toml, env, message):
    f = tmp_path / "r.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(CoordinatorConfig, "coordinator", f, environ=env)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(AgentConfig, "agent", tmp_path / "nope.toml", environ={})


@pytest.mark.parametrize("cls, section", [(AgentConfig, "agent"), (CoordinatorConfig, "coordinator")])
def test_configuration_reference_lists_every_key_with_its_default(cls, section):
    doc = (REPO / "docs" / "configuration.md").read_text()
    table = doc.split(f"## [{section}]", 1)[1].split("\n## ", 1)[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M))
    defaults = cls()
    assert set(documented) == set(cls.__struct_fields__)
    for name, shown in documented.items():
        value = getattr(defaults, name)
        assert shown == (repr(value) if isinstance(value, str) else str(value)), name
