"""The tag model's clients trained together (issue 33): equal to one-at-a-time local SGD within float rounding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedprivacy.client import sparse_cohort
from fedprivacy.client.sparse_cohort import compiled_local_steps, local_steps, train_sparse_cohort
from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.engines import cohorts
from fedprivacy.engines.cohorts import chunks_by_examples, cohort_trainer
from fedprivacy.models.logit_losses import SIGMOID_BINARY_CROSS_ENTROPY, SOFTMAX_CROSS_ENTROPY, closed_form_loss
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _random_start(model):
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@pytest.mark.parametrize("epochs", [1, 3])
def test_clients_trained_together_equal_local_sgd_one_at_a_time(small_config, epochs):
    task = load_task(small_config().data)
    model = _random_start(task.new_model())
    before = [p.detach().clone() for p in model.parameters()]
    clients = list(range(12))
    data = [task.client_data(c) for c in clients]
    sizes = [len(y) for _, y in data]
    assert min(sizes) < 10 and max(sizes) > 30  # users shorter than one batch and users with many steps
    kw = dict(epochs=epochs, batch_size=10, lr=2.0)
    together = train_sparse_cohort(model, data, rngs=[client_generator(0, 7, c) for c in clients], **kw)
    for c, (features, labels), mine in zip(clients, data, together):
        alone = local_sgd(model, features, labels, rng=client_generator(0, 7, c), **kw)
        assert torch.equal(mine.update.indices, alone.update.indices)
        assert mine.update.dim == alone.update.dim
        torch.testing.assert_close(mine.update.values, alone.update.values, rtol=1e-5, atol=1e-5)
        assert mine.train_loss == pytest.approx(alone.train_loss, rel=1e-5)
        assert mine.num_examples == alone.num_examples
        assert alone.update.values.abs().max() > 0.01  # they trained
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)  # the model is only read


def test_a_client_trained_with_others_equals_it_trained_alone(small_config):
    """Each client's rows are its own: the others in its chunk change nothing but the float rounding."""
    task = load_task(small_config().data)
    model = _random_start(task.new_model())
    data = [task.client_data(c) for c in range(5)]
    kw = dict(epochs=2, batch_size=10, lr=2.0)
    together = train_sparse_cohort(model, data, rngs=[client_generator(0, 1, c) for c in range(5)], **kw)
    alone = train_sparse_cohort(model, data[2:3], rngs=[client_generator(0, 1, 2)], **kw)[0]
    torch.testing.assert_close(together[2].update.values, alone.update.values, rtol=1e-6, atol=1e-6)


def test_chunks_by_examples_close_at_the_budget_largest_first():
    assert chunks_by_examples([5, 50, 1, 30, 20], 40) == [[1], [3, 4], [0, 2]]
    assert chunks_by_examples([5, 5], 100) == [[0, 1]]
    assert chunks_by_examples([], 10) == []


def test_a_tag_run_trained_together_matches_one_at_a_time_on_any_number_of_threads(small_config, tmp_path,
                                                                                    monkeypatch):
    trained = []

    def counting(model, clients, **kw):
        trained.append(len(clients))
        return train_sparse_cohort(model, clients, **kw)

    monkeypatch.setattr(cohorts, "train_sparse_cohort", counting)
    monkeypatch.setattr(cohorts, "SPARSE_CHUNK_EXAMPLES", 100)  # several chunks per round, in flight at once
    runs = {}
    for mode, processes in (("auto", 1), ("auto", 2), ("off", 1)):
        name = f"{mode}{processes}"
        cfg = small_config(f"cohort_batching={mode}", f"processes={processes}", f"output_dir={tmp_path / name}",
                           "rounds=3", "client.epochs=2")
        assert (cohort_trainer(cfg) is None) == (mode == "off")
        runs[name] = run(cfg)
    sampled = pd.read_csv(tmp_path / "auto1" / "metrics.csv")["cohort_sampled"].astype(int).sum()
    assert sum(trained) == 2 * sampled and len(trained) > 6  # both auto runs' clients, in chunks
    final = {name: torch.load(tmp_path / name / "final_model.pt") for name in runs}
    initial = torch.load(tmp_path / "off1" / "initial_model.pt")
    for name in final["off1"]:
        assert torch.equal(final["auto1"][name], final["auto2"][name])  # threads: bit-identical
        torch.testing.assert_close(final["auto1"][name], final["off1"][name], rtol=1e-5, atol=1e-5)
        assert not torch.equal(final["off1"][name], initial[name])
    assert runs["auto1"]["epsilon_rdp"] == runs["off1"]["epsilon_rdp"]
    assert runs["auto1"]["test_accuracy"] == pytest.approx(runs["off1"]["test_accuracy"], abs=1e-2)


def test_the_step_loop_is_compiled_so_chunks_train_without_pythons_lock():
    """TorchScript's interpreter runs the whole loop without the GIL: the trainer's threads then use every core."""
    assert isinstance(compiled_local_steps(), torch.jit.ScriptFunction)


@pytest.mark.parametrize("case", ["softmax", "sigmoid", "adadps_per_word", "adadps_per_coordinate"])
def test_the_compiled_step_loop_trains_exactly_as_the_python_loop(small_config, monkeypatch, case):
    """The compiled loop (run without graph rewrites) and the same function run by Python: the same bits."""
    task = _multilabel_task(small_config) if case == "sigmoid" else load_task(small_config().data)
    model = _random_start(task.new_model())
    data = [task.client_data(c) for c in range(8)]
    gen = torch.Generator().manual_seed(5)
    vocab, k = model.embedding.weight.shape
    preconditioner = {"adadps_per_word": {"embedding.weight": 0.5 + torch.rand(vocab, 1, generator=gen)},
                      "adadps_per_coordinate": {"embedding.weight": 0.5 + torch.rand(vocab, k, generator=gen),
                                                "bias": 0.5 + torch.rand(k, generator=gen)}}.get(case)
    kw = dict(epochs=2, batch_size=10, lr=20.0, loss=closed_form_loss(task), preconditioner=preconditioner)

    def trained():
        return train_sparse_cohort(model, data, rngs=[client_generator(0, 2, c) for c in range(8)], **kw)

    compiled = trained()
    monkeypatch.setattr(sparse_cohort, "compiled_local_steps", lambda: local_steps)
    python = trained()
    for a, b in zip(compiled, python):
        assert torch.equal(a.update.values, b.update.values) and a.train_loss == b.train_loss
    assert max(float(r.update.values.abs().max()) for r in python) > 1e-3  # they trained


def _multilabel_task(small_config):
    task = load_task(small_config("data.task=tag_multilabel").data)
    assert closed_form_loss(task) is SIGMOID_BINARY_CROSS_ENTROPY
    return task


@pytest.mark.parametrize("epochs", [1, 2])
def test_multilabel_clients_trained_together_equal_autograd_local_sgd_one_at_a_time(small_config, epochs):
    """The closed-form sigmoid BCE, batched over clients, equals autograd on ``MultiLabelTagTask.loss`` per client."""
    task = _multilabel_task(small_config)
    model = _random_start(task.new_model())
    clients = list(range(10))
    data = [task.client_data(c) for c in clients]
    assert max(int(t.sum(1).max()) for _, t in data) > 1  # posts with several tags
    kw = dict(epochs=epochs, batch_size=10, lr=50.0)
    together = train_sparse_cohort(model, data, rngs=[client_generator(0, 4, c) for c in clients],
                                   loss=SIGMOID_BINARY_CROSS_ENTROPY, **kw)
    for c, (features, tags), mine in zip(clients, data, together):
        closed = local_sgd(model, features, tags, rng=client_generator(0, 4, c), loss_fn=task.loss,
                           closed_form=SIGMOID_BINARY_CROSS_ENTROPY, **kw)
        autograd = local_sgd(model, features, tags, rng=client_generator(0, 4, c), loss_fn=task.loss, **kw)
        dense = autograd.update.to_dense()
        for result in (mine, closed):
            torch.testing.assert_close(result.update.to_dense(), dense, rtol=1e-5, atol=1e-6)
            assert result.train_loss == pytest.approx(autograd.train_loss, rel=1e-5)
            assert result.num_examples == autograd.num_examples
        assert dense.abs().max() > 1e-3  # they trained


@pytest.mark.parametrize("name", ["softmax", "sigmoid"])
def test_a_loss_written_into_a_statistic_equals_its_gradient_and_loss_exactly(name):
    """``gradient_into`` + ``losses_`` (the cohort's loop: the losses finished once for all steps) is ``gradient``."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(23, 7, generator=gen) * 4
    if name == "softmax":
        loss, targets = SOFTMAX_CROSS_ENTROPY, torch.randint(0, 7, (23,), generator=gen)
    else:
        loss, targets = SIGMOID_BINARY_CROSS_ENTROPY, (torch.rand(23, 7, generator=gen) < 0.3).float()
    g, losses = loss.gradient(logits.clone(), targets)
    statistic = torch.full((23,), float("nan"))
    g_into = loss.gradient_into(logits.clone(), targets, statistic)
    assert torch.equal(g_into, g)
    assert torch.equal(loss.losses_(statistic), losses)


def _heap_of_a_chunk_buffer(keep: bool) -> dict[str, int]:
    """glibc's ``mallinfo2`` around a 15 MB buffer (a chunk's rows) allocated then freed, in a fresh process: the
    bytes it added to mmapped blocks, to the heap (``arena``) and what freeing it took back from the heap."""
    code = ("import ctypes, json, torch\n"
            "from fedprivacy.engines.heap import keep_freed_memory\n"
            f"assert {keep} is False or keep_freed_memory()\n"
            "class Info(ctypes.Structure):\n"
            "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd',\n"
            "                                               'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]\n"
            "info = ctypes.CDLL('libc.so.6').mallinfo2\n"
            "info.restype = Info\n"
            "before = info()\n"
            "x = torch.empty(15 << 18)\n"
            "held = info()\n"
            "del x\n"
            "after = info()\n"
            "print(json.dumps({'mmapped': held.hblkhd - before.hblkhd, 'heap': held.arena - before.arena,\n"
            "                  'trimmed': held.arena - after.arena}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_chunk_buffer_stays_in_the_heap():
    """After ``keep_freed_memory`` a chunk-sized buffer comes from the heap and its memory stays there when freed
    (the next chunk's buffers reuse it, already mapped); by default it is a fresh ``mmap``, unmapped when freed."""
    kept, default = _heap_of_a_chunk_buffer(True), _heap_of_a_chunk_buffer(False)
    assert kept["mmapped"] == 0 and kept["heap"] >= 15 << 20 and kept["trimmed"] == 0
    assert default["mmapped"] >= 15 << 20
