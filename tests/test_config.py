"""Config loading: file, environment and overrides in layers, one clear error per mistake,
and docs/configuration.md in step with the defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from revenant.common.errors import ConfigError
from revenant.common.settings.config import GUIDE_NAMES, AgentConfig, CheckpointConfig, CoordinatorConfig, load_config
from revenant.common.settings.limits import POLICY_RANGES
from revenant.common.settings.resources import ResourcesConfig
from revenant.messages import CheckpointPolicy, SubmitRequest

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


def _doc_section(section: str) -> str:
    doc = (REPO / "docs" / "configuration.md").read_text()
    return doc.split(f"## [{section}]", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("cls, section", [(AgentConfig, "agent"), (CoordinatorConfig, "coordinator"),
                                          (CheckpointConfig, "checkpoint"), (ResourcesConfig, "resources")])
def test_configuration_reference_lists_every_key_with_its_default(cls, section):
    table = _doc_section(section)
    # (The rows of the guide's mapping table, `CRIU_...` | `key`, are checked on their own below.)
    documented = {k: v for k, v in re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M)
                  if not k.startswith("CRIU_")}
    defaults = cls()
    # A section held by another (the coordinator's [checkpoint]) has a table of its own.
    assert set(documented) == set(cls.__struct_fields__) - set(getattr(cls, "SECTIONS", {}))
    for name, shown in documented.items():
        value = getattr(defaults, name)
        assert shown == (repr(value) if isinstance(value, str) else str(value)), name


# ---------------------------------------------------------------------- [checkpoint]


def _checkpoint(tmp_path, toml: str, env: dict[str, str] | None = None) -> CheckpointConfig:
    f = tmp_path / "r.toml"
    f.write_text(toml)
    return load_config(CoordinatorConfig, "coordinator", f, environ=env or {}).checkpoint


def test_the_guide_table_maps_every_guide_option_to_its_key_default_and_range():
    rows = re.findall(r"^\| `(CRIU_\w+)` \| `(\w+)` \| ([^|]+) \| ([^|]+) \|", _doc_section("checkpoint"), re.M)
    assert {guide: key for guide, key, _, _ in rows} == GUIDE_NAMES
    # Every option but revenant's own (what a move does to a job's connections, and pack compression,
    # have no guide spelling).
    assert set(GUIDE_NAMES.values()) == set(CheckpointConfig.__struct_fields__) - {"connections", "pack_compression"}
    defaults = CheckpointConfig()
    for _, key, default, accepted in rows:
        value = getattr(defaults, key)
        shown = ("YES" if value else "NO") if isinstance(value, bool) else f"{value:g}"
        assert default.split()[0] == shown, key
        if key in POLICY_RANGES:
            lowest, highest, _ = POLICY_RANGES[key]
            assert accepted.strip().startswith(f"{lowest:g} to {highest:g}"), key
        else:
            assert accepted.strip() == "YES / NO", key


def test_checkpoint_defaults_are_the_guides():
    cfg = CoordinatorConfig().checkpoint
    assert cfg == CheckpointConfig(max_epochs=1, incremental=False, full_every=10, pre_dump=False,
                                   pre_dump_delay_s=5.0, load_aware=False, load_threshold_cpu=0.95,
                                   load_threshold_io=0.50, load_threshold_memory=0.85)
    assert cfg.policy() == CheckpointPolicy()


def test_the_checkpoint_section_takes_revenants_keys(tmp_path):
    cfg = _checkpoint(tmp_path, "[coordinator]\nname = 'c'\n[checkpoint]\nmax_epochs = 3\nincremental = true\n"
                                "full_every = 4\npre_dump_delay_s = 0\nload_threshold_io = 1\n")
    assert (cfg.max_epochs, cfg.incremental, cfg.full_every, cfg.pre_dump_delay_s, cfg.load_threshold_io) == \
        (3, True, 4, 0.0, 1.0)


def test_the_guides_lines_work_when_pasted_in_as_they_are(tmp_path):
    # The guide's own examples, verbatim: bare YES/NO, its spellings, a comment.
    cfg = _checkpoint(tmp_path, "[checkpoint]\nCheckpointType = checkpoint/criu\n"
                                "CRIU_Incremental = YES\nCRIU_FullEvery = 5\nCRIU_MaxEpochs = 2\n"
                                "CRIU_LoadAware = YES  # skip under load\nCRIU_LoadThresholdCPU = 0.90\n"
                                "CRIU_LoadThresholdIO = 0.60\nCRIU_LoadThresholdMemory = 0.80\n"
                                "CRIU_PreDump = NO\nCRIU_PreDumpDelay = 7\n")
    assert cfg == CheckpointConfig(max_epochs=2, incremental=True, full_every=5, pre_dump=False,
                                   pre_dump_delay_s=7.0, load_aware=True, load_threshold_cpu=0.90,
                                   load_threshold_io=0.60, load_threshold_memory=0.80)
    # Any case of the name and of YES/NO; a quoted "yes" too.
    assert _checkpoint(tmp_path, "[checkpoint]\ncriu_predump = yes\nCRIU_LOADAWARE = 'Yes'\n").pre_dump
    assert _checkpoint(tmp_path, "[checkpoint]\ncriu_predump = yes\nCRIU_LOADAWARE = 'Yes'\n").load_aware
    # The plug-in line names criu, which revenant is; another plug-in is refused, naming it.
    with pytest.raises(ConfigError, match=r"^\[checkpoint\] CheckpointType = 'checkpoint/blcr': revenant "
                                          r"checkpoints with criu only"):
        _checkpoint(tmp_path, "[checkpoint]\nCheckpointType = checkpoint/blcr\n")


def test_the_environment_overrides_the_checkpoint_section(tmp_path):
    env = {"REVENANT_CHECKPOINT_INCREMENTAL": "yes", "REVENANT_CHECKPOINT_FULL_EVERY": "3",
           "REVENANT_CHECKPOINT_LOAD_THRESHOLD_CPU": "0.5"}
    cfg = _checkpoint(tmp_path, "[checkpoint]\nCRIU_Incremental = NO\nCRIU_FullEvery = 9\n", env)
    assert (cfg.incremental, cfg.full_every, cfg.load_threshold_cpu) == (True, 3, 0.5)
    assert load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_CHECKPOINT_PRE_DUMP": "true"}
                       ).checkpoint.pre_dump
    with pytest.raises(ConfigError, match="REVENANT_CHECKPOINT_FULLEVERY"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_CHECKPOINT_FULLEVERY": "3"})


@pytest.mark.parametrize("toml, message", [
    ("[checkpoint]\nCRIU_Incremental = YES\nincremental = false\n",
     "[checkpoint] incremental is given twice, as CRIU_Incremental and as incremental: keep one"),
    ("[checkpoint]\nCRIU_MaxEpochs = 2\ncriu_maxepochs = 3\n", "max_epochs is given twice"),
    ("CRIU_Incremental = YES\n", "CRIU_Incremental must be in the [checkpoint] section"),
    ("[checkpoint]\nCRIU_FullEvery = 0\n", "[checkpoint] full_every must be a whole number from 1 to 1000, got 0"),
    ("[checkpoint]\nfull_every = 1001\n", "full_every must be a whole number from 1 to 1000, got 1001"),
    ("[checkpoint]\nmax_epochs = 0\n", "max_epochs must be a whole number from 1 to 100, got 0"),
    ("[checkpoint]\nCRIU_PreDumpDelay = -1\n", "pre_dump_delay_s must be a number from 0 to 3600, got -1.0"),
    ("[checkpoint]\nload_threshold_cpu = 1.5\n", "load_threshold_cpu must be a number from 0 to 1, got 1.5"),
    ("[checkpoint]\nCRIU_LoadThresholdIO = -0.1\n", "load_threshold_io must be a number from 0 to 1, got -0.1"),
    ("[checkpoint]\nload_threshold_memory = nan\n", "load_threshold_memory must be a number from 0 to 1, got nan"),
    ("[checkpoint]\nCRIU_Incremental = MAYBE\n", "r.toml"),
    ("[checkpoint]\nCRIU_Incremental = 'MAYBE'\n", "[checkpoint] Expected `bool`"),
    ("[checkpoint]\nCRIU_Bogus = 1\n", "CRIU_Bogus"),
    ("[checkpoint]\nfull_every = 2.5\n", "full_every"),
    ("checkpoint = 3\n", "[checkpoint] must be a table"),
    ("[coordinator]\ncheckpoint = {full_every = 3}\n", "go in a [checkpoint] section of their own"),
])
def test_bad_checkpoint_settings_are_one_line_naming_the_option_and_range(tmp_path, toml, message):
    with pytest.raises(ConfigError) as refused:
        _checkpoint(tmp_path, toml)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_bad_environment_value_names_the_option():
    with pytest.raises(ConfigError, match="full_every must be a whole number from 1 to 1000, got 0"):
        load_config(CoordinatorConfig, "coordinator", environ={"REVENANT_CHECKPOINT_FULL_EVERY": "0"})


def test_a_jobs_policy_is_the_sections_defaults_with_the_submits_overrides():
    section = CheckpointConfig(max_epochs=4, incremental=True, full_every=7, load_aware=True,
                               load_threshold_cpu=0.8)
    plain = SubmitRequest(argv=["true"])
    assert section.policy(plain) == CheckpointPolicy(incremental=True, full_every=7, load_aware=True,
                                                     load_threshold_cpu=0.8)
    assert section.max_epochs_for(plain) == 4
    assert section.max_epochs_for(SubmitRequest(argv=["true"], max_epochs=2)) == 2
    over = SubmitRequest(argv=["true"], incremental=False, full_every=2, pre_dump=True, pre_dump_delay_s=0.5,
                         load_aware=False)
    assert section.policy(over) == CheckpointPolicy(incremental=False, full_every=2, pre_dump=True,
                                                    pre_dump_delay_s=0.5, load_aware=False, load_threshold_cpu=0.8)


def test_the_fence_leaves_room_for_the_dead_mans_switch_within_the_lease(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text("[agent]\nlease_ttl_s = 1.7\nfence_timeout_s = 1.65\n")
    with pytest.raises(ConfigError, match=r"fence_timeout_s must be shorter than lease_ttl_s by more than 0\.1 s"):
        load_config(AgentConfig, "agent", f, environ={})
    f.write_text("[agent]\nlease_ttl_s = 1.7\nfence_timeout_s = 1.5\n")
    assert load_config(AgentConfig, "agent", f, environ={}).fence_timeout_s == 1.5
