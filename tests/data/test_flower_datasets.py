"""Flower Datasets partitions as a task (fedprivacy.flower_datasets): client i is exactly the records of user i,
a partitioner that splits a user is refused naming the user and its partitions, and crafted files and columns
give errors naming the file or the column. Local files only: nothing here touches the network."""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

datasets = pytest.importorskip("datasets")
partitioners = pytest.importorskip("flwr_datasets.partitioner")

from fedprivacy.data.flower_datasets import read_local  # noqa: E402
from fedprivacy.flower_datasets import FlowerDatasetsTask  # noqa: E402
from fedprivacy.task import Task  # noqa: E402

NaturalIdPartitioner, IidPartitioner = partitioners.NaturalIdPartitioner, partitioners.IidPartitioner


def _records(n: int = 90, users: int = 7, seed: int = 0) -> pd.DataFrame:
    """``n`` records of ``users`` writers in shuffled order: 3 scalar features, a label in 0..2, a device column
    (writer w0 writes on two devices, every other writer on one)."""
    rng = np.random.default_rng(seed)
    writer = rng.integers(0, users, n)
    return pd.DataFrame({"writer": [f"w{w}" for w in writer], "device": [f"d{w}{i % 2 * (w == 0)}"
                                                                         for i, w in enumerate(writer)],
                         "a": rng.normal(size=n).astype(np.float32), "b": rng.normal(size=n),
                         "c": rng.integers(-5, 5, n), "digit": rng.integers(0, 3, n)})


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 3)


def _write(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_json(path, orient="records", lines=True)
    return path


def _task(tmp_path: Path, frame: pd.DataFrame | None = None, partitioner=None, **kwargs) -> FlowerDatasetsTask:
    path = _write(_records() if frame is None else frame, tmp_path / "train.parquet")
    settings = {"features": ["a", "b", "c"], "label": "digit", "model": _model, "test": path, "dataset": path}
    return FlowerDatasetsTask(partitioner or NaturalIdPartitioner(partition_by="writer"), **(settings | kwargs))


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_partitions_are_exactly_the_records_grouped_by_the_user_column(tmp_path, suffix):
    frame = _records()
    path = _write(frame, tmp_path / f"train{suffix}")
    partitioner = NaturalIdPartitioner(partition_by="writer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one user per partition: nothing to warn about
        task = FlowerDatasetsTask(partitioner, dataset=path, test=path, features=["a", "b", "c"], label="digit",
                                  model=_model)
    assert isinstance(task, Task) and task.population == frame.writer.nunique() == 7
    seen = set()
    for i in range(task.population):
        user = partitioner.partition_id_to_natural_id[i]
        rows = frame[frame.writer == user]  # in file order, as the partitioner keeps them
        x, y = task.load_data(i, task.population)
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert np.array_equal(x.numpy(), rows[["a", "b", "c"]].to_numpy(np.float32))
        assert np.array_equal(y.numpy(), rows.digit.to_numpy())
        seen.add(user)
    assert seen == set(frame.writer)


def test_list_features_are_flattened_and_concatenated_in_the_order_named(tmp_path):
    table = pa.table({"u": [1, 1, 2], "img": pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 0], [1, 2]]]),
                      "s": [0.5, 1.5, 2.5], "y": [0, 1, 1]})
    pq.write_table(table, tmp_path / "t.parquet")
    task = FlowerDatasetsTask(NaturalIdPartitioner(partition_by="u"), dataset=tmp_path / "t.parquet",
                              test=tmp_path / "t.parquet", features=["s", "img"], label="y", model=lambda: None)
    x, y = task.client_data(0)
    assert x.tolist() == [[0.5, 1, 2, 3, 4], [1.5, 5, 6, 7, 8]] and y.tolist() == [0, 1]


def test_the_task_evaluates_and_baselines_on_the_test_records(tmp_path):
    frame = _records()
    test = _write(_records(40, seed=1), tmp_path / "test.csv")
    task = _task(tmp_path, frame, test=test)
    held_out = _records(40, seed=1)
    assert task.majority_baseline == np.mean(held_out.digit == frame.digit.value_counts().idxmax())
    model = task.new_model()
    with torch.no_grad():
        logits = model(torch.tensor(held_out[["a", "b", "c"]].to_numpy(np.float32)))
    labels = torch.tensor(held_out.digit.to_numpy())
    metrics = task.evaluate(model)
    assert metrics["test_accuracy"] == pytest.approx(float((logits.argmax(1) == labels).float().mean()))
    assert metrics["test_loss"] == pytest.approx(float(task.loss(logits, labels)), rel=1e-6)


class _SplitUser(partitioners.Partitioner):
    """A crafted partitioner: records of writer w1 go to partitions 0 and 2, everything else to partition 1."""

    def load_partition(self, partition_id):
        writers = np.array(self.dataset["writer"])
        first_w1 = int(np.flatnonzero(writers == "w1")[0])
        rule = {0: [first_w1], 2: np.flatnonzero(writers == "w1")[1:],
                1: np.flatnonzero(writers != "w1")}
        return self.dataset.select(rule[partition_id])

    @property
    def num_partitions(self):
        return 3


def test_a_partitioner_that_splits_a_user_is_refused_naming_the_user_and_its_partitions(tmp_path):
    with pytest.raises(ValueError, match=r"user 'w1' of column 'writer' has records in partitions 0, 2 of "
                                         r"_SplitUser: .*NaturalIdPartitioner\(partition_by='writer'\)"):
        _task(tmp_path, partitioner=_SplitUser(), user_column="writer")
    with pytest.raises(ValueError, match=r"user 'w\d' of column 'writer' has records in partitions \d, \d.* of "
                                         r"IidPartitioner \(and \d+ more users are split\)"):
        _task(tmp_path, partitioner=IidPartitioner(num_partitions=3), user_column="writer")


def test_partitioning_by_a_finer_column_than_the_user_is_refused(tmp_path):
    """Partitioned by device, and writer w0 wrote on two devices: w0 is split (the natural id is not the user)."""
    with pytest.raises(ValueError, match=r"user 'w0' of column 'writer' has records in partitions 0, 1 of "
                                         r"NaturalIdPartitioner\(partition_by='device'\)"):
        _task(tmp_path, partitioner=NaturalIdPartitioner(partition_by="device"), user_column="writer")


def test_whole_users_sharing_a_partition_warn_that_the_unit_is_the_partition(tmp_path):
    grouped = partitioners.GroupedNaturalIdPartitioner(partition_by="writer", group_size=2)
    with pytest.warns(UserWarning, match=r"partitions of GroupedNaturalIdPartitioner hold several users \(partition "
                                         r"0: 2\).*\(2 eps, \(1 \+ e\^eps\) delta\)"):
        task = _task(tmp_path, partitioner=grouped, user_column="writer")
    assert task.population == 4


def test_a_partitioner_without_a_user_column_warns_that_the_dp_unit_is_the_partition(tmp_path):
    with pytest.warns(UserWarning, match="IidPartitioner with no user column: the DP unit is the partition"):
        task = _task(tmp_path, partitioner=IidPartitioner(num_partitions=5))
    assert task.population == 5 and sum(len(task.client_data(i)[1]) for i in range(5)) == 90


class _WithEmpty(partitioners.Partitioner):
    """A crafted partitioner: the records split in two by parity of position, and two empty partitions."""

    def load_partition(self, partition_id):
        return self.dataset.select(range(partition_id, len(self.dataset), 2) if partition_id < 2 else [])

    @property
    def num_partitions(self):
        return 4


@pytest.mark.parametrize("user_column", [None, "writer"])
def test_an_empty_partition_is_refused_naming_it(tmp_path, user_column):
    with pytest.raises(ValueError, match=r"partitions 2, 3 of _WithEmpty are empty \(2 in all\)"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _task(tmp_path, _records().drop_duplicates("writer"), partitioner=_WithEmpty(), user_column=user_column)


@pytest.mark.parametrize("change, error", [
    (lambda f: f.drop(columns="b"), r"train.parquet: no column 'b' \(its columns: writer, device, a, c, digit\)"),
    (lambda f: f.drop(columns="writer"), r"train.parquet: no column 'writer'"),
    (lambda f: f.assign(digit=f.digit.astype(float)), r"label column 'digit' has type double, not integer class ids"),
    (lambda f: f.assign(digit=f.digit.astype(str)), r"label column 'digit' has type (large_)?string.*class_encode_column"),
    (lambda f: f.assign(b=f.b.astype(str)), r"feature column 'b' has type (large_)?string"),
    (lambda f: f.assign(writer=f.writer.where(f.index != 3, None)), r"user column 'writer' has 1 records without"),
    (lambda f: f.assign(digit=f.digit - 1), r"label column 'digit' holds -1"),
    (lambda f: f.assign(a=f.a.where(f.index != 0, np.inf)), r"feature column 'a' holds NaN or infinity"),
    (lambda f: f.assign(c=f.c.astype("Int64").where(f.index != 0, pd.NA)), r"column 'c' holds 1 missing values"),
])
def test_crafted_columns_are_refused_naming_the_column(tmp_path, change, error):
    """Each crafted training file, read as both the partitioned and the test records: construction fails (the
    per-record checks run on the test records at once, and on each partition at its first use)."""
    with pytest.raises(ValueError, match=error):
        _task(tmp_path, change(_records()))


def test_ragged_list_features_are_refused_on_the_partitions_first_use(tmp_path):
    table = pa.table({"u": [1, 1, 2], "v": pa.array([[1.0, 2.0], [3.0], [4.0, 5.0]]), "y": [0, 1, 0]})
    pq.write_table(table, tmp_path / "ragged.parquet")
    test = _write(pd.DataFrame({"v": [[1.0, 2.0]], "y": [0]}), tmp_path / "test.parquet")
    task = FlowerDatasetsTask(NaturalIdPartitioner(partition_by="u"), dataset=tmp_path / "ragged.parquet",
                              test=test, features="v", label="y", model=lambda: None)
    assert task.client_data(1)[0].tolist() == [[4.0, 5.0]]
    with pytest.raises(ValueError, match=r"partition 0 of NaturalIdPartitioner\(partition_by='u'\): column 'v' "
                                         r"holds lists of different lengths"):
        task.client_data(0)


def test_a_partition_whose_records_are_wider_than_the_test_records_is_refused(tmp_path):
    """Each partition's lists have one length, but not the test records' one: the model could not take both."""
    table = pa.table({"u": [1, 1, 2], "v": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0, 7.0]]), "y": [0, 1, 0]})
    pq.write_table(table, tmp_path / "train.parquet")
    test = _write(pd.DataFrame({"v": [[1.0, 2.0]], "y": [0]}), tmp_path / "test.parquet")
    task = FlowerDatasetsTask(NaturalIdPartitioner(partition_by="u"), dataset=tmp_path / "train.parquet",
                              test=test, features="v", label="y", model=lambda: None)
    assert task.client_data(0)[0].shape == (2, 2)
    with pytest.raises(ValueError, match=r"partition 1 of .*: 3 feature values per record in columns \('v',\), "
                                         r"the test records have 2"):
        task.client_data(1)


def test_the_population_must_match_the_supernodes_and_the_partition_must_exist(tmp_path):
    task = _task(tmp_path)
    with pytest.raises(ValueError, match=r"num-partitions is 10 but NaturalIdPartitioner\(partition_by='writer'\) has "
                                         r"7 partitions.*num-supernodes=7"):
        task.load_data(0, 10)
    with pytest.raises(ValueError, match=r"partition 7 of .*there are 7 \(0..6\)"):
        task.client_data(7)


def test_the_records_come_from_exactly_one_place(tmp_path):
    path = _write(_records(), tmp_path / "train.parquet")
    held = NaturalIdPartitioner(partition_by="writer")
    held.dataset = read_local(path)
    with pytest.raises(ValueError, match="dataset: the partitioner already holds a dataset"):
        FlowerDatasetsTask(held, dataset=path, test=path, features="a", label="digit", model=_model)
    assert FlowerDatasetsTask(held, test=path, features="a", label="digit", model=_model).population == 7
    with pytest.raises(ValueError, match="dataset: the partitioner holds no dataset"):
        FlowerDatasetsTask(IidPartitioner(3), test=path, features="a", label="digit", model=_model)
    with pytest.raises(TypeError, match="expected a datasets.Dataset or a file path, got int"):
        FlowerDatasetsTask(NaturalIdPartitioner(partition_by="writer"), dataset=path, test=3, features="a",
                           label="digit", model=_model)
    with pytest.raises(ValueError, match="features: name at least one"):
        FlowerDatasetsTask(NaturalIdPartitioner(partition_by="writer"), dataset=path, test=path, features=[],
                           label="digit", model=_model)


def test_bad_files_are_refused_naming_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing.parquet: no such file"):
        read_local(tmp_path / "nothing.parquet")
    (tmp_path / "data.xlsx").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"data.xlsx: unsupported file type '.xlsx'"):
        read_local(tmp_path / "data.xlsx")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken.parquet: cannot read it as Parquet"):
        read_local(tmp_path / "broken.parquet")
    pd.DataFrame({"a": []}).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty.parquet: cannot read it as Parquet"):
        read_local(tmp_path / "empty.parquet")


def test_a_dataset_without_records_is_refused(tmp_path):
    empty = datasets.Dataset.from_dict({"writer": [], "a": [], "digit": []},
                                       features=datasets.Features({"writer": datasets.Value("string"),
                                                                   "a": datasets.Value("float32"),
                                                                   "digit": datasets.Value("int64")}))
    with pytest.raises(ValueError, match=r"NaturalIdPartitioner\(partition_by='writer'\) has no partitions"):
        FlowerDatasetsTask(NaturalIdPartitioner(partition_by="writer"), dataset=empty, test=empty, features="a",
                           label="digit", model=_model)
    path = _write(_records(), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"test \(the dataset\) has no records"):
        FlowerDatasetsTask(NaturalIdPartitioner(partition_by="writer"), dataset=path, test=empty, features="a",
                           label="digit", model=_model)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=200), suffix=st.sampled_from([".parquet", ".csv", ".json", ".jsonl"]))
def test_any_bytes_are_read_or_refused_naming_the_file(tmp_path, payload, suffix):
    path = tmp_path / f"crafted{suffix}"
    path.write_bytes(payload)
    try:
        dataset = read_local(path)
    except ValueError as e:
        assert str(e).startswith(f"{path}: ")
    else:
        assert len(dataset) > 0


FEATURE = st.sampled_from(["int", "float", "list"] * 2 + ["str", "ragged", "null_int", "nan"])  # half usable
LABEL = st.sampled_from(["int"] * 3 + ["float", "str", "null_int"])


def _column(kind: str, n: int, rng: np.random.Generator) -> pa.Array:
    values = {"int": lambda: pa.array(rng.integers(0, 4, n)), "float": lambda: pa.array(rng.normal(size=n)),
              "str": lambda: pa.array([f"s{i}" for i in rng.integers(0, 3, n)]),
              "list": lambda: pa.array([list(rng.normal(size=2)) for _ in range(n)]),
              "ragged": lambda: pa.array([list(rng.normal(size=1 + i % 2)) for i in range(n)]),
              "null_int": lambda: pa.array([None if i == n - 1 else int(i % 3) for i in range(n)], pa.int64()),
              "nan": lambda: pa.array([np.nan if i == 0 else 1.0 for i in range(n)])}
    return values[kind]()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.tuples(FEATURE, FEATURE, LABEL), users=st.integers(1, 4), n=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_any_crafted_table_gives_the_grouped_records_or_an_error_naming_a_column(tmp_path, kinds, users, n, seed):
    """Columns f0, f1 (features) and y (label) of crafted types, user column u: either every partition is
    exactly the records of its user, or a ValueError names one of the crafted columns."""
    rng = np.random.default_rng(seed)
    table = pa.table({"u": rng.integers(0, users, n), **{name: _column(kind, n, rng)
                                                         for name, kind in zip(["f0", "f1", "y"], kinds)}})
    pq.write_table(table, tmp_path / "t.parquet")
    try:
        task = FlowerDatasetsTask(NaturalIdPartitioner(partition_by="u"), dataset=tmp_path / "t.parquet",
                                  test=tmp_path / "t.parquet", features=["f0", "f1"], label="y", model=lambda: None)
        clients = [task.client_data(i) for i in range(task.population)]
    except ValueError as e:
        assert any(f"column '{c}'" in str(e) for c in ("f0", "f1", "y")), e
        event("refused")
        return
    event("accepted")
    bad = {"str", "null_int", "nan"} | ({"ragged"} if n > 1 else set())  # one record's list is not ragged
    assert kinds[2] == "int" and not bad & set(kinds[:2])  # every bad one refused
    frame = table.to_pandas()
    for i, (x, y) in enumerate(clients):
        rows = frame[frame.u == task.partitioner.partition_id_to_natural_id[i]]
        expected = np.concatenate([np.stack(rows[c].to_numpy()).reshape(len(rows), -1) for c in ("f0", "f1")], 1)
        assert np.array_equal(x.numpy(), expected.astype(np.float32)) and y.tolist() == rows.y.tolist()


def test_importing_fedprivacy_imports_neither_datasets_nor_flwr_datasets():
    code = ("import sys, json, fedprivacy; fedprivacy.Task; "
            "print(json.dumps([m for m in ('datasets', 'flwr_datasets') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2]).stdout
    assert json.loads(out) == []


FACTORY = '''
import torch
from flwr_datasets.partitioner import NaturalIdPartitioner

from fedprivacy import FlowerDatasetsTask


def make(data_config):
    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(2, 2)

    return FlowerDatasetsTask(NaturalIdPartitioner(partition_by="user"), dataset=data_config.path / "train.csv",
                              test=data_config.path / "test.csv", features=["x0", "x1"], label="y", model=model)
'''


@pytest.mark.slow
def test_fedprivacys_own_run_trains_it_as_a_user_task(tmp_path, monkeypatch):
    """``data.task: module:factory`` returning a FlowerDatasetsTask: fedprivacy's engine trains the 30 users
    (label = sign of x0) under user-level DP."""
    from fedprivacy.config import build_config
    from fedprivacy.run import run

    rng = np.random.default_rng(0)
    for name, n in (("train", 600), ("test", 300)):
        x = rng.normal(size=(n, 2))
        pd.DataFrame({"user": rng.integers(0, 30, n), "x0": x[:, 0], "x1": x[:, 1],
                      "y": (x[:, 0] > 0).astype(int)}).to_csv(tmp_path / f"{name}.csv", index=False)
    (tmp_path / "fds_task.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = build_config({"rounds": 8, "eval_every": 8, "output_dir": str(tmp_path / "run"),
                        "data": {"task": "fds_task:make", "path": str(tmp_path)},
                        "client": {"epochs": 1, "batch_size": 10, "lr": 0.5},
                        "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.5, "expected_cohort": 10,
                                    "accountants": ["rdp"]}})
    summary = run(cfg)
    assert summary["rounds_completed"] == 8 and summary["test_accuracy"] > 0.8  # majority about 0.5
    assert 0 < summary["epsilon_rdp"] < 100


@pytest.mark.slow
def test_the_flower_app_in_your_data_runs_under_dp(tmp_path, monkeypatch, capsys):
    """docs/YOUR_DATA.md's "Flower Datasets" block, run as written (2 rounds instead of 40) on the example's
    Parquet files of digits by writer, on fedprivacy's in-process engine."""
    from fedprivacy.engines.inprocess import run_inprocess

    app = Path(__file__).parents[2] / "examples" / "flower_datasets"
    monkeypatch.syspath_prepend(str(app))
    pytest.importorskip("sklearn")
    from digit_writers.task import write_files

    train, test = write_files(tmp_path, 0)
    train.rename(tmp_path / "train.parquet")
    test.rename(tmp_path / "test.parquet")
    monkeypatch.chdir(tmp_path)
    doc = (Path(__file__).parents[2] / "docs" / "YOUR_DATA.md").read_text()
    code = doc[doc.index("## Flower Datasets"):].split("```python\n")[1].split("```")[0]
    assert code.count("num_rounds=40") == 1
    namespace = {"local_sgd": lambda model, x, y, loss: loss(model(x), y).backward()}
    exec(compile(code.replace("num_rounds=40", "num_rounds=2"), "YOUR_DATA.md", "exec"), namespace)
    run_inprocess(namespace["server_app"], namespace["client_app"], num_nodes=namespace["task"].population)
    assert namespace["task"].population == 100
    assert re.search(r"'rdp': \d+\.\d+", capsys.readouterr().out)  # the block's print(strategy.epsilons())


def test_a_federated_datasets_partitioner_and_test_split_over_local_files(tmp_path, monkeypatch):
    """FederatedDataset(dataset="parquet", data_files=...) reads local files (its telemetry switched off here):
    its shuffled train split, partitioned by writer, gives each writer's records exactly."""
    from flwr_datasets import FederatedDataset
    from flwr_datasets.common import telemetry

    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_ENABLED", "0")
    frame, held_out = _records(), _records(40, seed=1)
    files = {"train": str(_write(frame, tmp_path / "train.parquet")),
             "test": str(_write(held_out, tmp_path / "test.parquet"))}
    fds = FederatedDataset(dataset="parquet", data_files=files,
                           partitioners={"train": NaturalIdPartitioner(partition_by="writer")})
    task = FlowerDatasetsTask(fds.partitioners["train"], test=fds.load_split("test"), features=["a", "b", "c"],
                              label="digit", model=_model)
    assert task.population == 7 and task.source == "the partitioner's dataset"
    for i in range(7):
        rows = frame[frame.writer == task.partitioner.partition_id_to_natural_id[i]]
        x, y = task.client_data(i)
        got = sorted(map(tuple, np.column_stack([x.numpy(), y.numpy()]).tolist()))
        assert got == sorted(map(tuple, np.column_stack([rows[["a", "b", "c"]].to_numpy(np.float32),
                                                         rows.digit]).astype(np.float32).tolist()))
    assert sorted(task.evaluate(task.new_model())) == ["test_accuracy", "test_loss"]
