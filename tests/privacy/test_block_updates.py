"""Block-sparse client updates and the row-local trainer (issue "Speed"): the same vectors and the
same math as the flat COO / autograd paths they replace."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from flwr.app import Array

from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.fl.records import _array, _view, model_to_record, record_to_update, update_to_record, vector_to_record
from fedprivacy.models.logistic import SparseLogisticRegression
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.updates import RejectedUpdate, SparseUpdate


def _rows(n=13, vocab=40, seed=0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    x = sp.random(n, vocab, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    x.data[:] = rng.random(x.nnz, dtype=np.float32)
    return x


def _model(vocab=40, k=7) -> SparseLogisticRegression:
    torch.manual_seed(0)
    m = SparseLogisticRegression(vocab, k)
    with torch.no_grad():
        m.embedding.weight.normal_()
        m.bias.normal_()
    return m


def test_local_logits_and_closed_form_step_match_the_full_model_and_autograd():
    m, x = _model(), _rows()
    y = torch.from_numpy(np.random.default_rng(1).integers(0, 7, x.shape[0]))
    blocks, local = m.support_blocks(x)
    start = m.start_point()
    rows = np.random.default_rng(2).permutation(x.shape[0])[:9]
    bag = local.bag(rows)
    assert torch.allclose(m.local_logits(bag, start), m(x[rows]), atol=1e-6)
    # at start + delta (a later step): the logits of the moved model, and autograd's step on the delta
    delta = 0.3 * torch.randn(len(blocks), 7, generator=torch.Generator().manual_seed(4))
    moved = _model()
    with torch.no_grad():
        moved.bias += delta[0]
        moved.embedding.weight[blocks[1:] - 1] += delta[1:]
    assert torch.allclose(m.local_logits(bag, start, delta), moved(x[rows]), atol=1e-6)
    d = delta.clone().requires_grad_(True)
    ref_loss = torch.nn.functional.cross_entropy(m.local_logits(bag, start, d), y[rows])
    (ref_grad,) = torch.autograd.grad(ref_loss, d)
    lr = 0.7
    stepped = delta.clone()
    loss = m.local_sgd_step_(local, rows, start, stepped, y[rows], lr)
    assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert torch.allclose(stepped, delta - lr * ref_grad, atol=1e-6)
    assert not torch.equal(stepped[0], delta[0]) and not torch.equal(stepped[1:], delta[1:])
    # the first step may skip reading its (zero) delta: the same step
    first, read = torch.zeros_like(delta), torch.zeros_like(delta)
    m.local_sgd_step_(local, rows, start, first, y[rows], lr, delta_is_zero=True)
    m.local_sgd_step_(local, rows, start, read, y[rows], lr)
    assert torch.equal(first, read) and first.abs().max() > 0


def test_training_from_a_flat_starting_point_equals_training_a_model_holding_it():
    m, x = _model(), _rows(n=25)
    y = np.random.default_rng(3).integers(0, 7, x.shape[0])
    point = torch.randn(sum(p.numel() for p in m.parameters()), generator=torch.Generator().manual_seed(5))
    holder = _model()
    torch.nn.utils.vector_to_parameters(point, holder.parameters())
    kw = dict(epochs=2, batch_size=10, lr=0.5)
    from_point = local_sgd(m, x, y, rng=client_generator(0, 1, 4), start_from=point, **kw).update
    from_holder = local_sgd(holder, x, y, rng=client_generator(0, 1, 4), **kw).update
    assert torch.equal(from_point.indices, from_holder.indices)
    assert torch.equal(from_point.values, from_holder.values)
    assert not torch.equal(from_point.values, local_sgd(m, x, y, rng=client_generator(0, 1, 4), **kw).update.values)


def test_support_blocks_are_the_update_support_as_whole_rows():
    m, x = _model(), _rows()
    blocks, _ = m.support_blocks(x)
    flat = (blocks[:, None] * m.block_size + torch.arange(m.block_size)).reshape(-1)
    assert torch.equal(flat, m.update_support(x))


def test_row_local_sgd_equals_dense_autograd_sgd_and_leaves_the_model_untouched():
    m, x = _model(), _rows(n=25)
    y = np.random.default_rng(3).integers(0, 7, x.shape[0])
    before = [p.detach().clone() for p in m.parameters()]
    result = local_sgd(m, x, y, epochs=2, batch_size=10, lr=0.5, rng=client_generator(0, 1, 4))
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    # reference: dense logistic regression, the same batches, plain autograd SGD
    w, b = before[1].clone().requires_grad_(True), before[0].clone().requires_grad_(True)
    dense = torch.from_numpy(x.toarray())
    rng = client_generator(0, 1, 4)
    for _ in range(2):
        order = rng.permutation(x.shape[0])
        for lo in range(0, x.shape[0], 10):
            idx = order[lo:lo + 10]
            loss = torch.nn.functional.cross_entropy(dense[idx] @ w + b, torch.from_numpy(y[idx]))
            gw, gb = torch.autograd.grad(loss, (w, b))
            with torch.no_grad():
                w -= 0.5 * gw
                b -= 0.5 * gb
    expected = torch.cat([(b - before[0]).reshape(-1), (w - before[1]).reshape(-1)]).detach()
    assert result.update.block == m.block_size
    assert torch.allclose(result.update.to_dense(), expected, atol=1e-6)


def test_block_update_validation_and_private_sum_match_flat_coo():
    dim, blk = 12, 3
    vals = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1
    block = SparseUpdate(torch.tensor([1, 3]), vals, dim)
    flat = SparseUpdate(torch.tensor([3, 4, 5, 9, 10, 11]), vals.reshape(-1).clone(), dim)
    assert block.block == blk and block.is_well_formed(dim)
    assert torch.equal(block.to_dense(), flat.to_dense())
    for bad in ([3, 1], [1, 1], [1, 4], [-1, 2]):  # unsorted, repeated, out of range
        assert not SparseUpdate(torch.tensor(bad), vals, dim).is_well_formed(dim)
    assert not SparseUpdate(torch.tensor([0, 1]), torch.ones(2, 5), dim).is_well_formed(dim)  # 5 does not divide 12
    a = PrivateSum(dim, clip_norm=2.0, noise_multiplier=0.0, expected_cohort=1.0)
    b = PrivateSum(dim, clip_norm=2.0, noise_multiplier=0.0, expected_cohort=1.0)
    assert a.add_(block) and b.add_(flat)
    assert torch.allclose(a._sum, b._sum) and a.stats.norms == b.stats.norms
    assert torch.equal(vals, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1)  # not mutated
    c = PrivateSum(dim, clip_norm=2.0, noise_multiplier=0.0, expected_cohort=1.0)
    assert not c.add_(SparseUpdate(torch.tensor([1, 3]), torch.tensor([[1.0, float("nan"), 0], [0, 0, 0]]), dim))
    assert c.stats.rejected["nonfinite"] == 1


def test_block_update_round_trips_through_its_record_and_encoding_matches_np_save():
    update = SparseUpdate(torch.tensor([0, 2]), torch.randn(2, 4), 16)
    decoded = record_to_update(update_to_record(update), 16)
    assert torch.equal(decoded.indices, update.indices) and torch.equal(decoded.values, update.values)
    for a in (np.arange(5, dtype=np.int64), np.random.rand(3, 4).astype(np.float32), np.zeros((0, 4), np.float32),
              np.array(2.5, np.float32)):
        assert _array(a).data == Array(a).data
        assert np.array_equal(_view(Array(a)), a) and _view(Array(a)).shape == a.shape
    with pytest.raises(RejectedUpdate, match="values of shape"):  # 2-D needs indices
        record_to_update(update_to_record(SparseUpdate(None, torch.ones(2, 8), 16)), 16)


def test_the_broadcast_of_a_vector_is_the_models_record_after_loading_it_and_leaves_the_model_alone():
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    vector = torch.randn(sum(p.numel() for p in m.parameters()))
    record = vector_to_record(vector, m)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    torch.nn.utils.vector_to_parameters(vector, m.parameters())
    expected = model_to_record(m)
    assert list(record.keys()) == list(expected.keys())
    assert all(record[k].data == expected[k].data and record[k].shape == expected[k].shape for k in record.keys())
    with pytest.raises(ValueError, match="does not fill"):
        vector_to_record(vector[1:], m)
