"""Crafted config values (non-finite, huge, negative, wrong types) are refused naming the field."""

import math
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fedprivacy.config import MAX_NOISE_STD, ConfigError, RunConfig, build_config
from fedprivacy.privacy.bounds import MAX_NOISE_MULTIPLIER, MIN_DELTA, MIN_NOISE_MULTIPLIER

NON_FINITE = st.sampled_from([math.inf, -math.inf, math.nan, ".inf", "-.inf", ".nan"])
HUGE = st.floats(min_value=MAX_NOISE_STD * 1.0001, max_value=1.7976931348623157e308)
WRONG_TYPE = st.sampled_from(["abc", [1.0], {"a": 1}, "1.0.0"])
FIELDS = ["privacy.clip_norm", "privacy.noise_multiplier", "client.sample_dp.clip_norm",
          "client.sample_dp.noise_multiplier"]


def _tree(field: str, value) -> dict:
    """A config tree setting the dotted ``field`` to ``value`` (``value`` as YAML would give it)."""
    *sections, name = field.split(".")
    tree: dict = {}
    node = tree
    for part in sections:
        node = node.setdefault(part, {})
    node[name] = value
    return tree


def _refused(field: str, value) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(_tree(field, value))
    return str(err.value)


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(FIELDS), value=st.one_of(NON_FINITE, HUGE, WRONG_TYPE))
def test_non_finite_huge_or_mistyped_clip_and_noise_are_refused_naming_the_field(field, value):
    assert field in _refused(field, value)


@settings(max_examples=30, deadline=None)
@given(field=st.sampled_from(FIELDS), value=st.floats(max_value=-1e-300, allow_nan=False))
def test_negative_clip_and_noise_are_refused_naming_the_field(field, value):
    assert field in _refused(field, value)


@settings(max_examples=30, deadline=None)
@given(z=st.floats(min_value=1.0, max_value=MAX_NOISE_MULTIPLIER), c=st.floats(min_value=1.0, max_value=MAX_NOISE_STD))
def test_a_noise_std_whose_square_overflows_is_refused_naming_both_fields(z, c):
    tree = {"privacy": {"noise_multiplier": z, "clip_norm": c}}
    if z * c <= MAX_NOISE_STD:
        assert math.isfinite((z * c) ** 2) and build_config(tree).privacy.clip_norm == c
    else:
        with pytest.raises(ConfigError, match=r"privacy\.noise_multiplier \* privacy\.clip_norm"):
            build_config(tree)


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["privacy.noise_multiplier", "client.sample_dp.noise_multiplier"]),
       z=st.one_of(st.floats(min_value=5e-324, max_value=MIN_NOISE_MULTIPLIER, exclude_max=True),
                   st.floats(min_value=MAX_NOISE_MULTIPLIER, max_value=MAX_NOISE_STD, exclude_min=True)))
def test_a_noise_multiplier_the_accountants_cannot_compute_is_refused_naming_the_field(field, z):
    """Hardening II, finding 3: z = 1e-300 crashed after release 1, z = 1e-30 without naming the field."""
    assert f"{field}:" in _refused(field, z)


@pytest.mark.parametrize("field", ["privacy.delta", "client.sample_dp.target_delta"])
@pytest.mark.parametrize("delta", [1e-300, MIN_DELTA / 2, 1.0, 2.0])
def test_a_delta_the_accountants_cannot_compute_is_refused_naming_the_field(field, delta):
    assert f"{field}:" in _refused(field, delta)


@pytest.mark.parametrize("override", ["privacy.clip_norm=.inf", "privacy.clip_norm=1e308",
                                      "privacy.noise_multiplier=.inf", "privacy.noise_multiplier=.nan",
                                      "round_timeout_s=.inf", "client.lr=.nan"])
def test_the_testers_overrides_are_refused_naming_the_field(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        build_config({}, [override])


def test_a_bad_value_of_a_union_field_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["privacy.noise_multiplier=.inf"])
    assert str(err.value).splitlines()[1:] == ["  privacy.noise_multiplier: Input should be a finite number or 'auto' "
                                               "(got inf)"]


def _float_fields(model, prefix: str = "") -> list[str]:
    """Dotted names of the float fields of ``model`` and of its always-present sections."""
    names = []
    for name, info in model.model_fields.items():
        if isinstance(info.default, BaseModel):
            names += _float_fields(type(info.default), f"{prefix}{name}.")
        elif float in get_args(info.annotation) or info.annotation is float:
            names.append(prefix + name)
    return names


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(_float_fields(RunConfig)), value=NON_FINITE)
def test_no_config_float_takes_inf_or_nan(field, value):
    assert field in _refused(field, value)


@pytest.mark.parametrize("content", [b"\x00\xff\xfe garbage", b"a: [1, 2\n", b"- a list\n", b"\t\tfoo: : :\n"])
def test_a_garbage_config_file_is_refused_naming_the_file(tmp_path, content):
    """Hardening II, finding 6: a file that is not UTF-8 gave an error that did not name it."""
    from fedprivacy.config import load_config

    path = tmp_path / "garbage.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


# -- hardening III: a config naming a plug-in runs code, only with the runner's opt-in --------------------------
_PLANTED = """
import pathlib
pathlib.Path(__file__).with_name("imported").write_text("ran")
"""


@pytest.mark.parametrize("field", ["privacy.noise_stream", "data.task", "privacy.sampling", "server.optimizer"])
def test_the_commands_refuse_a_config_naming_a_plugin_without_allow_plugins(field, tmp_path, monkeypatch, capsys):
    import yaml

    from fedprivacy.cli import EXIT_USAGE, main

    (tmp_path / "planted_plugin.py").write_text(_PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**_tree(field, "planted_plugin:make"), "output_dir": str(tmp_path / "run")}))
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({"name": "s", "output_dir": str(tmp_path / "study"),
                                     "base": _tree(field, "planted_plugin:make"),
                                     "methods": {"m": {}}, "budgets": [{"noise_multiplier": 1.0}]}))
    for command in (["run", str(config)], ["audit", str(config)], ["deploy", "local", str(config), "--supernodes", "2"],
                    ["run", "--set", f"{field}=planted_plugin:make"], ["compare", str(study)]):
        assert main(command) == EXIT_USAGE, command
        err = capsys.readouterr().err.strip()
        assert f"{field}='planted_plugin:make' names a plug-in" in err and "--allow-plugins" in err, command
        assert len(err.splitlines()) == 1 and not (tmp_path / "imported").exists(), command
    if field == "data.task":  # the opt-in: the run imports the module (then finds no factory ``make`` in it)
        assert main(["run", str(config), "--allow-plugins"]) == EXIT_USAGE
        assert "cannot import 'planted_plugin:make'" in capsys.readouterr().err
        assert (tmp_path / "imported").read_text() == "ran"


def test_the_python_api_and_configs_without_plugins_need_no_opt_in():
    from fedprivacy.config import check_plugins, plugins

    for overrides in ([], ["data.task=next_word"], ["privacy.mechanism.kind=tree", "privacy.sampling=min_separated",
                                                     "privacy.groups=2", "privacy.accountants=[rdp]"]):
        cfg = build_config({}, overrides)
        assert plugins(cfg) == {}
        check_plugins(cfg, allowed=False)
    cfg = build_config({}, ["privacy.noise_stream=a.b:c", "data.task=d:e"])
    assert plugins(cfg) == {"data.task": "d:e", "privacy.noise_stream": "a.b:c"}
    check_plugins(cfg, allowed=True)
