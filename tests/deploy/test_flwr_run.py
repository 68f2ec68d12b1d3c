"""`flwr run .` in the project root: the typed run-config keys, the SuperNode / population check, and
(slow) a real run on Flower's local simulation federation."""

from __future__ import annotations

import json
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from fedprivacy.config import ConfigError, build_config, config_differences
from fedprivacy.fl.run_config import BASE_KEYS, RUN_CONFIG_KEYS, config_from_run_config
from fedprivacy.fl.population import PopulationMismatch, discover_nodes

ROOT = Path(__file__).resolve().parents[2]
DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
DEFAULTS = build_config({}).model_dump(mode="json")


def test_pyproject_declares_every_key_with_the_quickstart_default():
    assert DECLARED == {**BASE_KEYS, **{k.key: k.default for k in RUN_CONFIG_KEYS}}
    cfg, resume = config_from_run_config(DECLARED)
    assert cfg == build_config({}) and resume is False  # the shipped keys are the embedded defaults


NEW_VALUES = {"num-server-rounds": 3, "num-users": 7, "noise-multiplier": 0.5, "target-epsilon": 4.0,
              "clip-norm": 2.5, "expected-cohort": 5, "server-optimizer": "adam", "server-lr": 0.1,
              "client-lr": 0.5, "local-epochs": 2, "batch-size": 4, "seed": 9, "data-path": "/tmp/d",
              "output-dir": "/tmp/o"}


@pytest.mark.parametrize("key", [k for k in RUN_CONFIG_KEYS], ids=lambda k: k.key)
def test_each_key_overrides_exactly_its_field(key):
    cfg, _ = config_from_run_config({**DECLARED, key.key: NEW_VALUES[key.key]})
    changed = config_differences(DEFAULTS, cfg.model_dump(mode="json"))
    side_effects = {"server.momentum"} if key.key == "server-optimizer" else set()  # sgd's only
    assert set(changed) - side_effects == {key.field}
    assert changed[key.field][1] == NEW_VALUES[key.key]


def test_keys_are_typed():
    cfg, _ = config_from_run_config({**DECLARED, "noise-multiplier": 2, "num-users": 0})  # int for a float; 0 = all
    assert cfg.privacy.noise_multiplier == 2.0 and cfg.data.max_clients is None
    assert config_from_run_config({**DECLARED, "noise-multiplier": "auto", "target-epsilon": 3.0})[0] \
        .privacy.noise_multiplier == "auto"
    with pytest.raises(ConfigError, match="'num-server-rounds' must be an integer"):
        config_from_run_config({**DECLARED, "num-server-rounds": "3"})
    with pytest.raises(ConfigError, match="'num-server-rounds' must be an integer"):
        config_from_run_config({**DECLARED, "num-server-rounds": 2.5})
    with pytest.raises(ConfigError, match="'server-lr' must be a number"):
        config_from_run_config({**DECLARED, "server-lr": True})
    with pytest.raises(ConfigError, match="'noise-multiplier' must be a number or 'auto'"):
        config_from_run_config({**DECLARED, "noise-multiplier": "big"})
    # a value of the right type that the config rejects: the error names the field and the key
    with pytest.raises(ConfigError, match=r"(?s)privacy.clip_norm.*clip-norm -> privacy.clip_norm"):
        config_from_run_config({**DECLARED, "clip-norm": -1.0})
    with pytest.raises(ConfigError, match=r"(?s)server.optimizer.*server-optimizer"):
        config_from_run_config({**DECLARED, "server-optimizer": "sgdd"})


def test_an_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="unknown run config key.*'rounds'"):
        config_from_run_config({**DECLARED, "rounds": 3})


PLUGIN = "json:loads"  # any importable callable: what matters is that the apps would import and call it


@pytest.mark.parametrize("base", ["config-json", "config-yaml", "key"])
def test_a_plugin_needs_the_run_config_opt_in(tmp_path, base):
    """A plug-in named by the config file, its JSON or a typed key would make the ServerApp and every ClientApp
    import and call that code: refused naming the field and the opt-in unless ``allow-plugins = true``."""
    tree = {"server": {"optimizer": PLUGIN}}
    rc = {**DECLARED, "server-optimizer": PLUGIN} if base == "key" else {**DECLARED}
    if base == "config-json":
        rc["config-json"] = json.dumps(tree)
    elif base == "config-yaml":
        (tmp_path / "c.yaml").write_text(f"server: {{optimizer: '{PLUGIN}'}}\n")
        rc["config-yaml"] = str(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match=r"server\.optimizer='json:loads' names a plug-in.*allow-plugins=true"):
        config_from_run_config(rc)
    cfg, _ = config_from_run_config({**rc, "allow-plugins": True})
    assert cfg.server.optimizer == PLUGIN


@pytest.mark.parametrize("value", ["true", 1, "yes", None])
def test_the_plugin_opt_in_must_be_a_boolean(value):
    with pytest.raises(ConfigError, match="'allow-plugins' must be true or false"):
        config_from_run_config({**DECLARED, "server-optimizer": PLUGIN, "allow-plugins": value})


def test_deploy_local_writes_the_opt_in_only_for_a_config_naming_a_plugin(tmp_path):
    from fedprivacy.deploy.local import LocalDeployment

    deployment = LocalDeployment(tmp_path, 2, secure=False)
    for allowed in (False, True):
        app = deployment.write_app(tmp_path / "config.yaml", allow_plugins=allowed)
        declared = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
        assert declared["allow-plugins"] is allowed and set(declared) <= set(BASE_KEYS)


def test_keys_override_a_base_yaml_only_where_set(tmp_path):
    yaml_file = tmp_path / "base.yaml"
    yaml_file.write_text("rounds: 7\nprivacy: {noise_multiplier: 0.3, expected_cohort: 20}\n")
    cfg, _ = config_from_run_config({**DECLARED, "config-yaml": str(yaml_file), "expected-cohort": 10})
    assert (cfg.rounds, cfg.privacy.noise_multiplier, cfg.privacy.expected_cohort) == (7, 0.3, 10)
    # a deployment's generated app declares only the base keys
    cfg, resume = config_from_run_config({"config-yaml": str(yaml_file), "resume": True})
    assert cfg.rounds == 7 and resume is True
    cfg, _ = config_from_run_config({"config-json": build_config({"rounds": 4}).to_json()})
    assert cfg.rounds == 4


class _Reply:
    def __init__(self, node, partition):
        from flwr.app import ConfigRecord, RecordDict

        self.content = RecordDict({"node": ConfigRecord({"partition-id": partition})})
        self.metadata = type("M", (), {"src_node_id": node})()

    def has_error(self):
        return False


class _FakeGrid:
    """``nodes`` SuperNodes (partition i on node id 100 + i), the first ``early`` of them registered at once."""

    def __init__(self, nodes, early=None, late_after=None):
        self.nodes, self.early, self.late_after, self.start = nodes, early, late_after, time.monotonic()

    def get_node_ids(self):
        late = self.late_after is not None and time.monotonic() - self.start > self.late_after
        count = self.nodes if self.early is None or late else self.early
        return [100 + i for i in range(count)]

    def send_and_receive(self, messages, timeout=None):
        return [_Reply(m.metadata.dst_node_id, m.metadata.dst_node_id - 100) for m in messages]


def test_too_few_supernodes_fail_after_a_short_grace_period():
    t0 = time.monotonic()
    with pytest.raises(PopulationMismatch) as err:
        discover_nodes(_FakeGrid(3), 5, settle=0.3)
    assert time.monotonic() - t0 < 2
    assert str(err.value).startswith('3 SuperNodes registered but the data has 5 users: run with '
                                     '--federation-config "num-supernodes=5" or set --run-config "num-users=3"')


def test_too_many_supernodes_fail_at_once():
    t0 = time.monotonic()
    with pytest.raises(PopulationMismatch, match="7 SuperNodes registered but the data has 5 users"):
        discover_nodes(_FakeGrid(7), 5, settle=30)
    assert time.monotonic() - t0 < 1


def test_late_registrations_within_the_grace_period_are_waited_for(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):  # as the engines set it before a ServerApp sends messages
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)
    assert discover_nodes(_FakeGrid(5, early=2, late_after=0.2), 5, settle=2) == [100, 101, 102, 103, 104]
    assert discover_nodes(_FakeGrid(5), 5) == [100, 101, 102, 103, 104]


# -- slow: the real `flwr run .` ------------------------------------------------------------------
@pytest.mark.slow
def test_flwr_run_in_the_project_root(tmp_path, small_data, flwr_cli):
    flwr, env = flwr_cli
    out = tmp_path / "run"

    def flwr_run(supernodes: int, keys: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(flwr), "run", ".", "--stream", "--run-config", keys,
                               "--federation-config", f"num-supernodes={supernodes}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)

    keys = (f"num-server-rounds=2 num-users=4 expected-cohort=2 noise-multiplier=0.5 "
            f"data-path='{small_data}' output-dir='{out}'")
    mismatch = flwr_run(3, keys)
    assert '3 SuperNodes registered but the data has 4 users: run with --federation-config ' \
           '"num-supernodes=4"' in mismatch.stdout + mismatch.stderr
    assert not (out / "checkpoint.pt").exists()
    done = flwr_run(4, keys)
    assert (out / "summary.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rounds_completed"], summary["population"], summary["noise_multiplier"]) == (2, 4, 0.5)
    unknown = flwr_run(4, "rounds=3")
    assert unknown.returncode != 0 and "Invalid run configuration" in unknown.stdout + unknown.stderr


@pytest.mark.slow
def test_the_server_app_generates_missing_default_data_then_checks_the_population(tmp_path, monkeypatch):
    from flwr.app import Context, RecordDict

    from fedprivacy.fl.server_app import app

    monkeypatch.chdir(tmp_path)  # the default data.path, data/synthetic, is relative: an empty folder here
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={**DECLARED, "num-users": 3, "expected-cohort": 2, "output-dir": str(tmp_path / "run")})
    with pytest.raises(PopulationMismatch, match="2 SuperNodes registered but the data has 3 users"):
        app(grid=_FakeGrid(2), context=context)
    assert (tmp_path / "data" / "synthetic" / "stackoverflow.sqlite").exists()
