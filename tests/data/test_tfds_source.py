"""``data.source: tfds``: a TensorFlow Datasets dataset prepared in TFDS's own on-disk format (array_record or
parquet, written here by a small ``tfds.core.GeneratorBasedBuilder`` without TensorFlow) read as a federated
classification task, its public pool feeding AdaDPS's side information and centralized training."""

from __future__ import annotations

import json
import socket
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tfds = pytest.importorskip("tensorflow_datasets")

from fedprivacy.centralized import train_centralized  # noqa: E402
from fedprivacy.cli import main  # noqa: E402
from fedprivacy.config import ConfigError, build_config  # noqa: E402
from fedprivacy.data.tfds_source import TFDSError, open_dataset  # noqa: E402
from fedprivacy.data.views import sample_clients  # noqa: E402
from fedprivacy.fl.side_information import SideInformationBroadcast  # noqa: E402
from fedprivacy.optim.adadps import ADADPS_STREAM, rmsprop_preconditioner  # noqa: E402
from fedprivacy.optim.sample_dp import SampleDPConfig  # noqa: E402
from fedprivacy.stackoverflow_tasks import load_task  # noqa: E402
from fedprivacy.tfds_task import group_by_client, tfds_task  # noqa: E402

tfds.disable_progress_bar()
FEATURES = {"x": tfds.features.Tensor(shape=(3,), dtype=np.float32),
            "meta": {"pixels": tfds.features.Tensor(shape=(2, 2), dtype=np.uint8, encoding="zlib")},
            "label": tfds.features.ClassLabel(num_classes=3),
            "user": tfds.features.Text(),
            "note": tfds.features.Text()}


def prepare(data_dir: Path, name: str, features: dict, splits: dict[str, list[dict]],
            file_format: str = "array_record") -> Path:
    """Write ``splits`` as TFDS dataset ``name`` 1.0.0 into ``data_dir`` with TFDS's own builder (records in the
    order given: no shuffling)."""
    class_name = "".join(part.title() for part in name.split("_"))

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                     disable_shuffling=True)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in splits}

    def _generate_examples(self, split):
        yield from enumerate(splits[split])

    with tfds.core.registered.skip_registration():
        builder_cls = type(class_name, (tfds.core.GeneratorBasedBuilder,),
                           {"VERSION": tfds.core.Version("1.0.0"), "_info": _info,
                            "_split_generators": _split_generators, "_generate_examples": _generate_examples})
    builder_cls(data_dir=str(data_dir), file_format=file_format).download_and_prepare()
    return data_dir


def records(n: int, users: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=3).astype(np.float32),
             "meta": {"pixels": rng.integers(0, 256, size=(2, 2)).astype(np.uint8)},
             "label": int(rng.integers(3)), "user": f"user-{int(rng.integers(users))}", "note": "free text"}
            for _ in range(n)]


SPLITS = {"train": records(80, 9, 0), "test": records(30, 4, 1), "validation": records(24, 3, 2)}
SECTION = {"name": "user_points", "client_feature": "user", "inputs": ["x", "meta/pixels"], "label": "label",
           "public_split": "validation", "input_scale": 0.5, "hidden": 4}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("tfds"), "user_points", FEATURES, SPLITS)


def data_config(data_dir: Path, **changes):
    section = {**SECTION, "data_dir": str(data_dir), **changes}
    return build_config({"data": {"source": "tfds", "tfds": section}}).data


def flat(record: dict, scale: float = 0.5) -> np.ndarray:
    return (np.r_[record["x"], record["meta"]["pixels"].ravel()].astype(np.float64) * scale).astype(np.float32)


@pytest.mark.parametrize("file_format", ["array_record", "parquet"])
def test_the_partition_is_the_records_grouped_by_user(data_dir, tmp_path, file_format):
    if file_format == "parquet":
        data_dir = prepare(tmp_path, "user_points", FEATURES, SPLITS, file_format="parquet")
    task = load_task(data_config(data_dir))
    by_user = defaultdict(list)
    for r in SPLITS["train"]:
        by_user[r["user"].encode()].append(r)
    assert list(task.client_ids) == sorted(by_user) and task.population == len(by_user)
    for i, user in enumerate(task.client_ids):
        x, y = task.client_data(i)
        assert np.array_equal(x.numpy(), np.stack([flat(r) for r in by_user[user]]))
        assert y.tolist() == [r["label"] for r in by_user[user]]
    assert np.array_equal(task.test_inputs.numpy(), np.stack([flat(r) for r in SPLITS["test"]]))
    assert task.test_labels.tolist() == [r["label"] for r in SPLITS["test"]]
    assert np.array_equal(task.public_examples()[0].numpy(), np.stack([flat(r) for r in SPLITS["validation"]]))
    train_labels = [r["label"] for r in SPLITS["train"]]
    majority = max(range(3), key=lambda k: (train_labels.count(k), -k))
    assert task.majority_baseline == np.mean([r["label"] == majority for r in SPLITS["test"]])


def test_group_by_client_is_a_stable_grouping():
    ids = np.array([5, 2, 5, 7, 2, 5])
    order, partition, distinct = group_by_client(ids)
    assert distinct.tolist() == [2, 5, 7] and order.tolist() == [1, 4, 0, 2, 5, 3]
    assert partition.starts.tolist() == [0, 2, 5] and partition.stops.tolist() == [2, 5, 6]


def test_selection_options_apply(data_dir):
    full = load_task(data_config(data_dir))
    capped = tfds_task("user_points", data_dir, client_feature="user", inputs=["x", "meta/pixels"], label="label",
                       input_scale=0.5, max_clients=4, max_examples_per_client=2, max_test_examples=7)
    assert capped.population == 4 and capped.client_ids.tolist() == full.client_ids[:4].tolist()
    for i in range(4):
        assert torch.equal(capped.client_data(i)[0], full.client_data(i)[0][:2])
    assert len(capped.test_labels) == 7 and capped.public_examples() is None
    sampled = tfds_task("user_points", data_dir, client_feature="user", inputs=["x", "meta/pixels"], label="label",
                        input_scale=0.5, client_sample=3, client_sample_seed=1)
    kept = sample_clients(full.population, 3, 1)
    assert sampled.client_ids.tolist() == full.client_ids[kept].tolist()
    assert torch.equal(sampled.client_data(2)[0], full.client_data(int(kept[2]))[0])
    with pytest.raises(ConfigError, match="tfds.label"):
        tfds_task("user_points", data_dir, client_feature="user", inputs=["x"], label="")


def test_the_side_information_path_takes_the_public_pool_and_equals_it_by_hand(data_dir):
    cfg = build_config({"seed": 3, "data": {"source": "tfds", "tfds": {**SECTION, "data_dir": str(data_dir)}},
                        "client": {"adadps": {"source": "rmsprop", "public_batch_size": 5}}})
    task = load_task(cfg.data)
    model = task.new_model()
    broadcast = SideInformationBroadcast(cfg, task)
    assert broadcast.update(0, model)
    # by hand, from the generated records: one pass of batches of 5 in the seeded order, v = mean of g^2
    x = torch.from_numpy(np.stack([flat(r) for r in SPLITS["validation"]]))
    y = torch.tensor([r["label"] for r in SPLITS["validation"]])
    order = np.random.default_rng(np.random.SeedSequence([3, ADADPS_STREAM, 0])).permutation(len(y))
    v = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    batches = [np.sort(order[lo:lo + 5]) for lo in range(0, len(y), 5)]
    for idx in batches:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        for name, p in model.named_parameters():
            v[name] += p.grad ** 2 / len(batches)
    side = broadcast.side
    assert sorted(side.tensors) == ["0.weight", "2.weight"]  # the bias keeps A = 1 (precondition_bias: false)
    for name, a in side.tensors.items():
        torch.testing.assert_close(a, rmsprop_preconditioner(v[name], 1e-5, True), rtol=1e-5, atol=0)
    assert side.provenance["public_pool"] == {"split": "validation", "posts": 24}


def test_the_public_pool_pretrains_centrally(data_dir):
    task = load_task(data_config(data_dir))
    model = task.new_model()
    before = [p.detach().clone() for p in model.parameters()]
    result = train_centralized(model, task.public_dataset(), SampleDPConfig(lr=0.1, noise_multiplier=1.0,
                                                                           clip_norm=1.0, batch_size=8.0),
                               seed=0, target_delta=1e-3, steps=3,
                               loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(logits, y, reduction="none"))
    assert result.steps == 3 and result.epsilon > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fedprivacy_run_trains_it_end_to_end(data_dir, tmp_path, capsys):
    config = tmp_path / "tfds.yaml"
    config.write_text(yaml.safe_dump({
        "rounds": 3, "eval_every": 1, "output_dir": str(tmp_path / "run"),
        "data": {"source": "tfds", "tfds": {**SECTION, "data_dir": str(data_dir)}},
        "client": {"epochs": 1, "batch_size": 4, "lr": 0.1, "adadps": {"source": "rmsprop"}},
        "privacy": {"noise_multiplier": 0.5, "clip_norm": 1.0, "expected_cohort": 4, "accountants": ["rdp"]}}))
    assert main(["run", str(config), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and 0 < summary["epsilon_rdp"] < 1e3
    assert summary["data"]["source"] == "tfds" and summary["data"]["dataset"] == "user_points/1.0.0"
    assert 0 <= summary["test_accuracy"] <= 1
    built = json.loads((tmp_path / "run" / "side_information.json").read_text())
    assert built[0]["public_pool"]["split"] == "validation"


@pytest.mark.parametrize("changes, field, named", [
    ({"name": "no_such_data"}, "data.tfds.name", "'no_such_data' is not prepared"),
    ({"name": "user_points:9.9.9"}, "data.tfds.name", "user_points:9.9.9"),
    ({"train_split": "training"}, "data.tfds.train_split", "'training'"),
    ({"test_split": "test[:300%]"}, "data.tfds.test_split", "'test[:300%]'"),
    ({"public_split": "heldout"}, "data.tfds.public_split", "'heldout'"),
    ({"public_split": "train[:10%]"}, "data.tfds.public_split", "shares 8 record(s)"),
    ({"inputs": ["x", "meta/colour"]}, "data.tfds.inputs", "'meta/colour'"),
    ({"inputs": ["note"]}, "data.tfds.inputs", "'note' of 'user_points/1.0.0' is a Text"),
    ({"label": "y"}, "data.tfds.label", "'y'"),
    ({"label": "x", "inputs": ["meta/pixels"]}, "data.tfds.label", "label must be a scalar integer"),
    ({"num_classes": 4}, "data.tfds.num_classes", "ClassLabel of 3 classes"),
    ({"client_feature": "uid"}, "data.tfds.client_feature", "'uid'"),
    ({"client_feature": "x", "inputs": ["meta/pixels"]}, "data.tfds.client_feature", "float32 of shape (3,)"),
])
def test_each_error_names_the_field_and_the_thing(data_dir, changes, field, named):
    with pytest.raises(TFDSError) as err:
        load_task(data_config(data_dir, **changes))
    assert field in str(err.value) and named in str(err.value)


def test_a_missing_data_dir_or_dataset_is_never_downloaded(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(TFDSError, match="data.tfds.data_dir .* is not a folder.*tfds build"):
        open_dataset("mnist", tmp_path / "absent")
    with pytest.raises(TFDSError, match="dataset 'mnist' is not prepared in data_dir .*tfds build .*never downloads"):
        open_dataset("mnist", tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing downloaded, nothing written


def test_a_tfrecord_dataset_is_refused_with_how_to_prepare_it(data_dir, tmp_path):
    copy = tmp_path / "user_points" / "1.0.0"
    copy.mkdir(parents=True)
    for f in (data_dir / "user_points" / "1.0.0").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    info = json.loads((copy / "dataset_info.json").read_text())
    info["fileFormat"] = "tfrecord"
    (copy / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(TFDSError, match="stored as tfrecord, which needs TensorFlow.*file_format=array_record"):
        open_dataset("user_points", tmp_path)


def test_the_cli_names_the_problem(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"source": "tfds", "tfds": {**SECTION, "data_dir": str(tmp_path)}}}))
    assert main(["run", str(config), "--quiet"]) == 2
    assert "dataset 'user_points' is not prepared" in capsys.readouterr().err


@pytest.mark.parametrize("data, field", [
    ({"source": "tfds"}, "needs the data.tfds section"),
    ({"source": "tfds", "task": "tag", "tfds": {**SECTION, "data_dir": "d"}}, "trains data.task=classification"),
    ({"tfds": {**SECTION, "data_dir": "d"}}, "need data.source=tfds"),
    ({"task": "classification"}, "need data.source=tfds"),
    ({"source": "tfds", "view": "adadps", "tfds": {**SECTION, "data_dir": "d"}}, "does not read data.view"),
    ({"source": "tfds", "tfds": {**SECTION, "data_dir": "d", "client_feature": None}}, "data.tfds.client_feature"),
    ({"source": "tfds", "tfds": {**SECTION, "data_dir": "d", "inputs": ["x", "label"]}}, "'label' is named twice"),
])
def test_data_sections_that_do_not_fit_are_refused(data, field):
    with pytest.raises(ConfigError, match=field):
        build_config({"data": data})


@pytest.mark.parametrize("adadps, named", [({"source": "top_words"}, "rule over word indices"),
                                           ({"source": "rmsprop"}, "set data.tfds.public_split")])
def test_adadps_with_tfds_needs_rmsprop_and_a_public_split(adadps, named):
    section = {**SECTION, "data_dir": "d", "public_split": None}
    with pytest.raises(ConfigError, match=named):
        build_config({"data": {"source": "tfds", "tfds": section}, "client": {"adadps": adadps}})


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(["name", "train_split", "test_split", "public_split", "client_feature", "label"]),
       value=st.one_of(TEXT, st.sampled_from(["", " ", "mnist ", "../x", "MNIST", "a:b", "a/b/c", "x[:5%", "-"]),
                       st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2)))
def test_crafted_field_values_are_accepted_only_in_their_syntax(field, value):
    from fedprivacy.config import TFDS_FEATURE, TFDS_NAME, TFDS_SPLIT

    pattern = {"name": TFDS_NAME, "client_feature": TFDS_FEATURE, "label": TFDS_FEATURE}.get(field, TFDS_SPLIT)
    tree = {"source": "tfds", "tfds": {**SECTION, "data_dir": "d", "inputs": ["x"], field: value}}
    nullable = field in ("public_split",)
    try:
        cfg = build_config({"data": tree})
    except ConfigError as err:
        assert f"tfds.{field}" in str(err)
        taken = ("x", "label", "user")  # the section's other features: a second use is refused
        assert not (isinstance(value, str) and pattern.fullmatch(value) and value not in taken) \
            and not (value is None and nullable)
        return
    got = getattr(cfg.data.tfds, field)
    assert got == value and (got is None and nullable or pattern.fullmatch(got))


@settings(max_examples=40, deadline=None)
@given(inputs=st.one_of(st.just([]), st.just("x"), st.lists(TEXT, min_size=1, max_size=3), st.integers()),
       classes=st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3)),
       scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2)))
def test_crafted_lists_and_numbers_name_their_field(inputs, classes, scale):
    tree = {**SECTION, "data_dir": "d", "inputs": inputs, "num_classes": classes, "input_scale": scale}
    try:
        cfg = build_config({"data": {"source": "tfds", "tfds": tree}}).data.tfds
    except ConfigError as err:
        assert any(f"tfds.{f}" in str(err) for f in ("inputs", "num_classes", "input_scale", "label"))
        return
    assert len(cfg.inputs) >= 1 and cfg.num_classes >= 2 and cfg.input_scale > 0 and np.isfinite(cfg.input_scale)


@pytest.fixture(scope="module")
def lie_dir(tmp_path_factory):
    """A counter giving each hypothesis example its own folder."""
    root = tmp_path_factory.mktemp("lies")
    return lambda: root / str(len(list(root.iterdir())))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(labels=st.lists(st.integers(-2, 5), min_size=4, max_size=12))
def test_a_label_out_of_range_is_named_with_its_record(lie_dir, labels):
    features = {"x": tfds.features.Tensor(shape=(2,), dtype=np.float32), "y": np.int64, "uid": np.int64}
    rows = [{"x": np.full(2, i, np.float32), "y": y, "uid": i % 3} for i, y in enumerate(labels)]
    root = prepare(lie_dir(), "lying_labels", features, {"train": rows, "test": rows[:2]})
    section = {"name": "lying_labels", "data_dir": str(root), "client_feature": "uid", "inputs": ["x"], "label": "y",
               "num_classes": 4}
    data = build_config({"data": {"source": "tfds", "tfds": section}}).data
    bad = [i for i, y in enumerate(labels) if not 0 <= y < 4]
    if not bad:
        assert sorted(torch.cat([load_task(data).client_data(c)[1] for c in range(3)]).tolist()) == sorted(labels)
        return
    with pytest.raises(TFDSError, match=rf"data.tfds.label: record {bad[0]} of split 'train' .* label {labels[bad[0]]}, "
                                        r"outside \[0, 4\)"):
        load_task(data)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["float32", "float64", "bool", "int32", "uint8", "int64", "string", "vector"]),
       nan=st.booleans())
def test_a_user_id_of_the_wrong_dtype_or_a_non_finite_input_is_refused(lie_dir, kind, nan):
    spec = (tfds.features.Text() if kind == "string" else tfds.features.Tensor(shape=(2,), dtype=np.int64)
            if kind == "vector" else tfds.features.Tensor(shape=(), dtype=np.dtype(kind)))
    value = {"string": lambda i: f"u{i % 2}", "vector": lambda i: np.array([i % 2, 0]),
             "bool": lambda i: bool(i % 2)}.get(kind, lambda i: np.dtype(kind).type(i % 2))
    rows = [{"x": np.array([np.nan if nan and i == 3 else i], np.float32), "y": i % 2, "uid": value(i)}
            for i in range(6)]
    features = {"x": tfds.features.Tensor(shape=(1,), dtype=np.float32), "y": tfds.features.ClassLabel(num_classes=2),
                "uid": spec}
    root = prepare(lie_dir(), "lying_ids", features, {"train": rows, "test": rows})
    section = {"name": "lying_ids", "data_dir": str(root), "client_feature": "uid", "inputs": ["x"], "label": "y"}
    data = build_config({"data": {"source": "tfds", "tfds": section}}).data
    if kind in ("float32", "float64", "bool", "vector"):
        with pytest.raises(TFDSError, match="data.tfds.client_feature: feature 'uid' .* a user id must be a scalar"):
            load_task(data)
    elif nan:
        with pytest.raises(TFDSError, match="data.tfds.inputs: record 3 of split 'train' .* non-finite input"):
            load_task(data)
    else:
        assert load_task(data).population == 2
