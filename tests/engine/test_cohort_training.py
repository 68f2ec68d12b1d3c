"""Cohorts trained together (issue 24, item 3): the batched local SGD equals one-at-a-time training."""

import textwrap

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from fedprivacy.client.cohort_training import train_cohort, unsupported_reason
from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.config import ConfigError, build_config
from fedprivacy.data.next_word import special_tokens
from fedprivacy.engines import cohorts
from fedprivacy.engines.cohorts import AUTO_MIN_COHORT, cohort_trainer
from fedprivacy.engines.inprocess import InProcessGrid
from fedprivacy.models.lstm import NextWordLSTM
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import NextWordTask, load_task

MLP_TASK = textwrap.dedent('''
    """A user's task with a small MLP: 24 users of 1 to 47 examples (one user with fewer than a batch)."""
    import torch
    from torch import nn


    class Points:
        population = 24
        majority_baseline = 1 / 3

        def __init__(self, data_config):
            gen = torch.Generator().manual_seed(0)
            self.x = [torch.randn(1 + 2 * i, 6, generator=gen) for i in range(24)]
            self.test_x = torch.randn(300, 6, generator=gen)

        @staticmethod
        def label(x):
            return (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()

        def new_model(self, device="cpu"):
            torch.manual_seed(1)
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)

        def client_data(self, index):
            return self.x[index], self.label(self.x[index])

        def loss(self, logits, labels):
            return nn.functional.cross_entropy(logits, labels)

        def evaluate(self, model):
            with torch.no_grad():
                accuracy = (model(self.test_x).argmax(1) == self.label(self.test_x)).float().mean()
            return {"test_accuracy": float(accuracy)}


    def make(data_config):
        return Points(data_config)
''')


@pytest.fixture
def mlp_task(tmp_path, monkeypatch):
    (tmp_path / "cohort_points.py").write_text(MLP_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cohort_points:make"


def _one_at_a_time(model, clients, loss_fn, **kw):
    return [local_sgd(model, x, y, rng=client_generator(7, 3, i), loss_fn=loss_fn, **kw)
            for i, (x, y) in enumerate(clients)]


def _together(model, clients, loss_fn, **kw):
    return train_cohort(model, clients, rngs=[client_generator(7, 3, i) for i in range(len(clients))],
                        loss_fn=loss_fn, **kw)


def _assert_same_results(want, got, atol):
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.num_examples == b.num_examples
        assert a.update.indices is None and b.update.indices is None and a.update.dim == b.update.dim  # dense
        assert torch.allclose(a.update.values, b.update.values, rtol=1e-4, atol=atol)
        assert b.train_loss == pytest.approx(a.train_loss, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("epochs", [1, 3])
def test_a_user_tasks_mlp_trained_together_equals_one_at_a_time(mlp_task, epochs):
    """Clients of 1..47 examples (batch 5: short last batches; 3 epochs: they fall mid-run, gathered)."""
    task = load_task(build_config({"data": {"task": mlp_task}}).data)
    model = task.new_model()
    clients = [task.client_data(i) for i in (0, 5, 23, 2, 11, 1)]
    kw = dict(epochs=epochs, batch_size=5, lr=0.3)
    want = _one_at_a_time(model, clients, task.loss, **kw)
    assert all(float(r.update.values.abs().max()) > 1e-3 for r in want)  # every client moved
    _assert_same_results(want, _together(model, clients, task.loss, **kw), atol=1e-6)


def test_the_next_word_lstm_trained_together_equals_one_at_a_time(small_config):
    """TFF's next-word model and masked loss on real (synthetic) clients of different sizes; the LSTM
    is narrowed (embedding 8, 12 units) to keep the test fast, its batched cell is the same code."""
    task = load_task(small_config("data.task=next_word").data)
    sizes = np.diff(np.stack([task.partition.starts, task.partition.stops]), axis=0)[0]
    picked = [int(i) for i in np.argsort(sizes, kind="stable")[[0, 10, 20, 30]]]
    clients = [tuple(a[:24] for a in task.client_data(i)) for i in picked]
    assert len({len(y) for _, y in clients}) > 2
    torch.manual_seed(0)
    model = NextWordLSTM(special_tokens(task.train.vocab_size).num_classes, embedding_size=8, lstm_size=12)
    kw = dict(epochs=2, batch_size=4, lr=0.5)
    _assert_same_results(_one_at_a_time(model, clients, NextWordTask.loss, **kw),
                         _together(model, clients, NextWordTask.loss, **kw), atol=1e-6)


def test_the_batched_lstm_and_its_backpropagation_through_time_are_torchs_lstm():
    torch.manual_seed(0)
    model = NextWordLSTM(30, embedding_size=5, lstm_size=7).double()
    tokens = torch.randint(0, 30, (3, 9))
    weights = torch.randn(3, 9, 30, dtype=torch.float64)
    params = dict(model.named_parameters())
    ours, torchs = model.vmap_forward(params, tokens), model(tokens)
    assert torch.allclose(ours, torchs, atol=1e-12)
    for a, b in zip(torch.autograd.grad((ours * weights).sum(), list(params.values())),
                    torch.autograd.grad((torchs * weights).sum(), list(params.values()))):
        assert torch.allclose(a, b, atol=1e-12)


def test_a_masked_step_leaves_a_clients_parameters_exactly_unchanged():
    """A client with no examples sits in the stack through every other client's steps and returns an
    exactly zero update; a client's update is bit for bit the same alone as beside longer clients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(1)
    clients = [(x, (x.sum(1) > 0).long()) for x in (torch.randn(n, 4, generator=gen) for n in (30, 0, 3, 17))]
    loss = nn.functional.cross_entropy
    together = _together(model, clients, loss, epochs=2, batch_size=4, lr=0.5)
    assert together[1].num_examples == 0 and together[1].train_loss == 0.0
    assert torch.equal(together[1].update.values, torch.zeros(together[1].update.dim))
    short_alone = train_cohort(model, [clients[2]], epochs=2, batch_size=4, lr=0.5, loss_fn=loss,
                               rngs=[client_generator(7, 3, 2)])
    assert torch.equal(short_alone[0].update.values, together[2].update.values)
    assert together[2].update.values.abs().max() > 0


def test_what_cannot_be_trained_together_is_named():
    assert "buffers" in unsupported_reason(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert "dropout" in unsupported_reason(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)))
    assert "recurrent" in unsupported_reason(nn.LSTM(2, 2))
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    assert "ties parameters" in unsupported_reason(tied)
    assert unsupported_reason(NextWordLSTM(10, 2, 3), np.zeros((1, 3)), np.zeros((1, 3))) is None
    with pytest.raises(ValueError, match="dropout"):
        train_cohort(nn.Dropout(0.1), [(torch.zeros(1, 2), torch.zeros(1))], epochs=1, batch_size=1, lr=1.0,
                     rngs=[np.random.default_rng(0)], loss_fn=nn.functional.mse_loss)


def _run_config(task, mode, tmp_path, cohort=12):
    return build_config({"rounds": 3, "eval_every": 3, "output_dir": str(tmp_path / mode),
                         "cohort_batching": mode, "data": {"task": task},
                         "client": {"epochs": 2, "batch_size": 4, "lr": 0.5},
                         "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.3, "expected_cohort": cohort,
                                     "accountants": ["rdp"]}})


def test_a_run_trained_together_matches_one_at_a_time(mlp_task, tmp_path, monkeypatch):
    trained = []

    def counting(model, clients, **kw):
        trained.append(len(clients))
        return train_cohort(model, clients, **kw)

    monkeypatch.setattr(cohorts, "train_cohort", counting)
    together = run(_run_config(mlp_task, "on", tmp_path))
    sampled = pd.read_csv(tmp_path / "on" / "metrics.csv")["cohort_sampled"]
    assert trained == [1] + sampled.astype(int).tolist() and len(sampled) == 3  # the trial, then each round's clients
    alone = run(_run_config(mlp_task, "off", tmp_path))
    assert together["epsilon_rdp"] == alone["epsilon_rdp"]
    assert together["cohort_accepted"] == alone["cohort_accepted"]
    a, b = (torch.load(tmp_path / mode / "final_model.pt") for mode in ("on", "off"))
    initial = torch.load(tmp_path / "off" / "initial_model.pt")
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-5), name
        assert not torch.equal(b[name], initial[name])
    assert together["test_accuracy"] == pytest.approx(alone["test_accuracy"], abs=1e-2)


def test_auto_trains_small_models_in_large_cohorts_together(mlp_task, small_config, tmp_path):
    assert cohort_trainer(_run_config(mlp_task, "auto", tmp_path, cohort=AUTO_MIN_COHORT)) is not None
    assert cohort_trainer(_run_config(mlp_task, "auto", tmp_path, cohort=AUTO_MIN_COHORT - 1)) is None
    assert cohort_trainer(_run_config(mlp_task, "off", tmp_path, cohort=AUTO_MIN_COHORT)) is None
    # the 4M-parameter LSTM is slower batched on the CPU: auto leaves it alone, on batches it
    assert cohort_trainer(small_config("data.task=next_word", "privacy.expected_cohort=100")) is None
    assert cohort_trainer(small_config("data.task=next_word", "cohort_batching=on")) is not None


NUMPY_MODEL_TASK = MLP_TASK.replace("import torch\n", "import numpy as np\nimport torch\n", 1).replace(
    "        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)",
    "        return NumpyModel()") + textwrap.dedent('''
    class NumpyModel(nn.Linear):
        """Reads its input through numpy, which vmap cannot batch."""

        def __init__(self):
            super().__init__(6, 3)

        def forward(self, x):
            return super().forward(torch.from_numpy(np.asarray(x)))
''')


def test_a_model_that_vmap_cannot_run_trains_one_at_a_time_or_is_refused(tmp_path, monkeypatch):
    assert "return NumpyModel()" in NUMPY_MODEL_TASK
    (tmp_path / "cohort_numpy.py").write_text(NUMPY_MODEL_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cohort_trainer(_run_config("cohort_numpy:make", "auto", tmp_path, cohort=AUTO_MIN_COHORT)) is None
    with pytest.raises(ConfigError, match="cohort_batching='on'.*a batched step of client 0 failed"):
        cohort_trainer(_run_config("cohort_numpy:make", "on", tmp_path))


def test_on_is_refused_where_clients_cannot_be_trained_together(small_config, mlp_task):
    with pytest.raises(ConfigError, match="cohort_batching='on'.*client.sample_dp"):
        cohort_trainer(small_config("cohort_batching=on", "client.sample_dp={noise_multiplier: 1.0}"))
    assert cohort_trainer(build_config({"cohort_batching": "on", "data": {"task": mlp_task},
                                        "client": {"compression": {"density": 0.5}}})) is not None
    with pytest.raises(ConfigError, match="cohort_batching"):
        build_config({"cohort_batching": "on", "engine": "ray"})
    assert build_config({"cohort_batching": "on", "processes": 2}).processes == 2  # its chunks run on 2 threads
    assert build_config({}, ["cohort_batching=off"]).cohort_batching == "off"  # YAML's boolean off


def test_after_a_cohort_fails_the_rest_of_its_clients_train_one_at_a_time():
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    app = ClientApp()

    @app.train()
    def train(msg, context):
        return Message(RecordDict({"r": ConfigRecord({"by": "client app"})}), reply_to=msg)

    class FailsAfterTwo:
        @staticmethod
        def handles(messages):
            return True

        @staticmethod
        def replies(messages, states):
            for msg in messages[:2]:
                yield Message(RecordDict({"r": ConfigRecord({"by": "cohort"})}), reply_to=msg)
            raise RuntimeError("out of memory")

    grid = InProcessGrid(app, num_nodes=5, cohort=FailsAfterTwo())
    replies = list(grid.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="train")
                                          for n in range(2, 7)]))
    assert [r.metadata.src_node_id for r in replies] == list(range(2, 7))
    assert [r.content["r"]["by"] for r in replies] == ["cohort"] * 2 + ["client app"] * 3
