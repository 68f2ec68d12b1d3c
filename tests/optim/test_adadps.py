"""AdaDPS side information (arXiv:2202.05963): each source's A, the preconditioned local
step against autograd, and A as a function of public inputs only (invariant 10)."""

import dataclasses
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from fedprivacy.client.trainer import client_generator, local_sgd, softmax_cross_entropy
from fedprivacy.config import AdaDPSConfig
from fedprivacy.fl.side_information import SideInformationBroadcast, build_side_information
from fedprivacy.models.logistic import SparseLogisticRegression
from fedprivacy.optim.adadps import (by_frequency, inverse_tfidf, public_batches, rmsprop_preconditioner,
                                     second_moments, two_level)
from fedprivacy.stackoverflow_tasks import WORD_COUNT, load_task

V, K = 12, 4


def _rows(n=30, seed=0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    x = sp.random(n, V, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    x.data[:] = rng.random(x.nnz, dtype=np.float32) + 0.1
    return x


def _model(seed=0) -> SparseLogisticRegression:
    m = SparseLogisticRegression(V, K)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.embedding.weight.copy_(torch.randn(V, K, generator=gen))
        m.bias.copy_(torch.randn(K, generator=gen))
    return m


def test_two_level_rule_is_the_paper_codes():
    a = two_level(V, top=3, multiplier=200.0)
    assert a.shape == (V, 1) and torch.equal(a[:3], torch.ones(3, 1))
    assert torch.allclose(a[3:], torch.full((V - 3, 1), 1 / 200))


def test_frequency_rule_is_proportional_and_capped():
    counts = np.array([1000, 500, 10, 0, 1])
    a = by_frequency(counts, cap=100.0).squeeze(1)
    assert torch.allclose(a, torch.tensor([1.0, 0.5, 0.01, 0.01, 0.01]))  # 1/cap floors 10/1000 = 0.01, 0, 0.001
    with pytest.raises(ValueError):
        by_frequency(np.zeros(3), cap=10.0)


def test_inverse_tfidf_by_hand():
    docs = sp.csr_matrix(np.array([[2, 1, 0], [0, 1, 0], [1, 0, 0]], dtype=np.float64))
    n, df = 3, np.array([2, 2, 0])
    idf = np.log((1 + n) / (1 + df)) + 1
    tfidf = docs.toarray() * idf
    tfidf /= np.linalg.norm(tfidf, axis=1, keepdims=True)
    summed = tfidf.sum(0)
    a = inverse_tfidf(docs * 0.25, cap=50.0).squeeze(1).double()  # per-row scaling does not matter
    assert torch.allclose(a[:2], torch.from_numpy(1 / summed[:2]), rtol=1e-6)
    assert a[2] == pytest.approx(50.0)  # a word absent from the pool: multiplier floored at 1 / cap


def _dense_mean_grads(model, batches):
    w, b = model.embedding.weight.detach().double(), model.bias.detach().double()
    out = []
    for x, y in batches:
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(torch.from_numpy(x.toarray()).double() @ wi + bi, torch.from_numpy(y))
        gw, gb = torch.autograd.grad(loss, (wi, bi))
        out.append((gw, gb))
    return out


def test_rmsprop_estimators_match_the_hand_computed_moments():
    x, y = _rows(n=23), np.random.default_rng(1).integers(0, K, 23)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    batches = list(public_batches(x, y, 5, np.random.default_rng(7)))
    assert [b[0].shape[0] for b in batches] == [5, 5, 5, 5, 3]
    grads = _dense_mean_grads(model, batches)
    epoch = second_moments(model, batches, softmax_cross_entropy, estimator="epoch")
    mean_w = torch.stack([g[0] ** 2 for g in grads]).mean(0)
    assert torch.allclose(epoch["embedding.weight"].double(), mean_w, rtol=1e-5, atol=1e-9)
    assert torch.allclose(epoch["bias"].double(), torch.stack([g[1] ** 2 for g in grads]).mean(0), rtol=1e-5)
    running = second_moments(model, batches, softmax_cross_entropy, estimator="recurrence", beta=None)
    assert torch.allclose(running["embedding.weight"], epoch["embedding.weight"], rtol=1e-5, atol=1e-9)
    ema = second_moments(model, batches, softmax_cross_entropy, estimator="recurrence", beta=0.9)
    v = torch.zeros(V, K, dtype=torch.float64)
    for gw, _ in grads:
        v = 0.9 * v + 0.1 * gw ** 2
    assert torch.allclose(ema["embedding.weight"].double(), v, rtol=1e-5, atol=1e-9)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the model is only read
    v0 = torch.tensor([0.0, 4.0])
    assert torch.allclose(rmsprop_preconditioner(v0, 1e-4, inside_sqrt=True), torch.tensor([1e-2, math.sqrt(4 + 1e-4)]))
    assert torch.allclose(rmsprop_preconditioner(v0, 1e-4, inside_sqrt=False), torch.tensor([1e-4, 2 + 1e-4]))


@pytest.mark.parametrize("shape", ["word", "coordinate"])
def test_preconditioned_closed_form_step_matches_autograd(shape):
    m, x = _model(), _rows()
    y = torch.from_numpy(np.random.default_rng(1).integers(0, K, x.shape[0]))
    gen = torch.Generator().manual_seed(3)
    a_w = torch.rand(V, 1 if shape == "word" else K, generator=gen) + 0.2
    a_b = None if shape == "word" else torch.rand(K, generator=gen) + 0.5
    pre = {"embedding.weight": a_w} | ({} if a_b is None else {"bias": a_b})
    blocks, local = m.support_blocks(x)
    start = m.start_point()
    delta = 0.2 * torch.randn(len(blocks), K, generator=gen)  # a later step: the delta is not zero
    rows = np.random.default_rng(2).permutation(x.shape[0])[:11]
    d = delta.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(m.local_logits(local.bag(rows), start, d), y[rows])
    (grad,) = torch.autograd.grad(loss, d)
    divisor = torch.cat([(torch.ones(1, K) if a_b is None else a_b[None]),
                         a_w.index_select(0, blocks[1:] - 1).expand(-1, K)])
    stepped = delta.clone()
    m.local_sgd_step_(local, rows, start, stepped, y[rows], 0.7, m.inverse_preconditioner(pre, blocks))
    assert torch.allclose(stepped, delta - 0.7 * grad / divisor, atol=1e-6)


def test_unit_preconditioner_is_plain_local_sgd_bit_for_bit():
    m, x = _model(), _rows()
    y = np.random.default_rng(3).integers(0, K, x.shape[0])
    plain = local_sgd(m, x, y, epochs=2, batch_size=7, lr=0.5, rng=client_generator(0, 1, 2))
    ones = local_sgd(m, x, y, epochs=2, batch_size=7, lr=0.5, rng=client_generator(0, 1, 2),
                     preconditioner={"embedding.weight": torch.ones(V, 1)})
    assert torch.equal(plain.update.values, ones.update.values)


@pytest.mark.parametrize("with_bias", [False, True])
def test_autograd_path_divides_sparse_and_dense_gradients_like_the_closed_form(with_bias):
    """The generic trainer (tag_multilabel, any loss) divides EmbeddingBag's sparse gradient row by row."""
    m, x = _model(), _rows()
    y = np.random.default_rng(4).integers(0, K, x.shape[0])
    gen = torch.Generator().manual_seed(5)
    pre = {"embedding.weight": torch.rand(V, K, generator=gen) + 0.3}
    if with_bias:
        pre["bias"] = torch.rand(K, generator=gen) + 0.3
    closed = local_sgd(m, x, y, epochs=2, batch_size=9, lr=0.4, rng=client_generator(0, 3, 1), preconditioner=pre)
    generic = local_sgd(m, x, y, epochs=2, batch_size=9, lr=0.4, rng=client_generator(0, 3, 1), preconditioner=pre,
                        loss_fn=softmax_cross_entropy)
    assert torch.allclose(closed.update.to_dense(), generic.update.to_dense(), atol=1e-6)
    plain = local_sgd(m, x, y, epochs=2, batch_size=9, lr=0.4, rng=client_generator(0, 3, 1))
    assert not torch.allclose(plain.update.to_dense(), closed.update.to_dense(), atol=1e-4)


@pytest.mark.parametrize("source", ["top_words", "frequency", "tfidf", "rmsprop"])
def test_side_information_ignores_the_training_clients(small_config, source):
    """Invariant 10: A is built from the vocabulary file, the public pool and the released model only;
    replacing every training client's posts leaves it bit-identical."""
    cfg = small_config(f"client.adadps.source={source}", "data.public_clients=4")
    task = load_task(cfg.data)
    scrambled = dataclasses.replace(task, train=dataclasses.replace(
        task.train, features=sp.random(*task.train.features.shape, density=0.01, format="csr", dtype=np.float32,
                                       random_state=np.random.default_rng(9)),
        labels=np.random.default_rng(9).integers(0, task.train.num_tags, len(task.train.labels))))
    digests = []
    for t in (task, scrambled):
        side = SideInformationBroadcast(cfg, t)
        side.update(0, t.new_model())
        digests.append(side.builds[-1]["sha256"])
    assert digests[0] == digests[1]
    other = small_config(f"client.adadps.source={source}", "data.public_clients=2")
    side = SideInformationBroadcast(other, load_task(other.data))
    side.update(0, task.new_model())
    assert (side.builds[-1]["sha256"] != digests[0]) == (source in ("tfidf", "rmsprop"))  # the pool is an input


def test_frequency_side_information_reads_the_word_count_file_in_vocabulary_order(small_config):
    cfg = small_config("client.adadps={source: frequency, cap: 1000.0}")
    counts = [int(line.split()[1]) for line in (cfg.data.path / WORD_COUNT).read_text().splitlines()[:2000]]
    side = build_side_information(cfg.client.adadps, vocab_size=2000, word_count_path=cfg.data.path / WORD_COUNT,
                                  public=None, model=None, loss_fn=None, seed=0, released_round=0)
    expected = np.maximum(np.array(counts) / max(counts), 1e-3)
    assert torch.allclose(side.tensors["embedding.weight"].squeeze(1), torch.from_numpy(expected).float())
    assert side.provenance["word_count_file"]["path"].endswith(WORD_COUNT) and side.provenance["public"]


def test_scale_multiplies_every_source(small_config):
    a = AdaDPSConfig(source="top_words", top_words=5, multiplier=10.0)
    b = AdaDPSConfig(source="top_words", top_words=5, multiplier=10.0, scale=3.0)
    kw = dict(vocab_size=50, word_count_path=None, public=None, model=None, loss_fn=None, seed=0, released_round=0)
    assert torch.allclose(build_side_information(b, **kw).tensors["embedding.weight"],
                          3.0 * build_side_information(a, **kw).tensors["embedding.weight"])


def test_settings_a_source_does_not_read_are_refused_and_configs_round_trip(small_config):
    from fedprivacy.config import ConfigError, config_from_json

    with pytest.raises(ConfigError, match=r"client\.adadps\.cap"):
        small_config("client.adadps={source: top_words, cap: 5.0}")
    with pytest.raises(ConfigError, match=r"client\.adadps\.beta"):
        small_config("data.public_clients=2", "client.adadps={source: rmsprop, beta: 0.9}")
    for source in ("ones", "top_words", "frequency", "tfidf", "rmsprop"):
        cfg = small_config("data.public_clients=2", f"client.adadps.source={source}")
        assert config_from_json(cfg.to_json()) == cfg  # the deployment path ships the config as JSON


def test_adadps_optimizer_with_unit_a_is_the_wrapped_optimizer_and_scales_like_lr_for_sgd():
    from fedprivacy.optim.adadps import AdaDPSOptimizer

    def train(make, steps=5):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
        opt = make(model)
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    ones = lambda m: [torch.ones_like(p) for p in m.parameters()]  # noqa: E731
    for base in (lambda ps: torch.optim.SGD(ps, lr=0.3), lambda ps: torch.optim.Adam(ps, lr=0.05)):
        assert torch.equal(train(lambda m: AdaDPSOptimizer(base(m.parameters()), ones(m))),
                           train(lambda m: base(m.parameters())))  # A = 1: bit for bit
    c = 4.0
    scaled = train(lambda m: AdaDPSOptimizer(torch.optim.SGD(m.parameters(), lr=0.3), [c * a for a in ones(m)]))
    torch.testing.assert_close(scaled, train(lambda m: torch.optim.SGD(m.parameters(), lr=0.3 / c)))
    per_word = train(lambda m: AdaDPSOptimizer(torch.optim.SGD(m.parameters(), lr=0.3),
                                               [torch.linspace(0.5, 2, 6).expand(3, 6), torch.ones(3)]))
    assert not torch.allclose(per_word, train(lambda m: torch.optim.SGD(m.parameters(), lr=0.3)))
    with pytest.raises(ValueError, match="positive"):
        AdaDPSOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1), [torch.zeros(2, 2), torch.ones(2)])
