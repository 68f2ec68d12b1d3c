r"""AdaDPS side information: the public preconditioner ``A`` of federated AdaDPS.

Every local step divides the mini-batch gradient by a fixed, public ``A`` (Li et al. 2022,
arXiv:2202.05963v2, App. B, Alg. 3):

.. math:: w^{i,j+1} = w^{i,j} - \eta_l\, \nabla f(w^{i,j}) \oslash A, \qquad
          \Delta_i = w^{i,s} - w_t, \qquad \tilde\Delta_i = \mathrm{clip}(\Delta_i, C)

and the server adds its one Gaussian draw to the sum as in DP-FedAvg (the placement of the paper's
code, ``federated/flearn/trainers/dp-fedavg.py``, which its reported ε = 34 at σ = 0.3 matches: §6.2,
Fig. 6; Alg. 3 as printed adds the noise on each device). Sample-level DP clients divide each record's gradient by
``A`` before its clip (Alg. 1). ``A = 1`` is DP-FedAvg exactly; ``A -> cA`` equals ``lr -> lr / c``
locally, and with one local step ``(cA, C, server lr)`` equals ``(A, cC, server lr / c)``.

Sources (§4 Option 2, §5.1 and §6.1.2, and the paper's code, github.com/litian96/AdaDPS, where it
differs): ``A`` has one value per word (shape
``(V, 1)``, broadcast over the K classes of the word-indexed weight; the bias keeps A = 1) for

* ``top_words``: the paper code's two-level rule, A = 1 for the ``top`` most frequent words
  (vocabulary indices ``< top``, the vocabulary being ordered by frequency), ``1 / multiplier`` else;
* ``frequency``: :math:`A_j = \max(n_j / \max_l n_l,\ 1/\mathrm{cap})` from word counts ``n``;
* ``tfidf``: :math:`A_j = 1 / \mathrm{clamp}(\sum_{\text{docs}} \mathrm{tfidf}_{d,j}, 1/\mathrm{cap}, \mathrm{cap})`
  over the public pool (inversely proportional, as §6.1.2 and the code; smooth idf
  :math:`\ln\frac{1+N}{1+\mathrm{df}_j} + 1`, rows L2-normalised as scikit-learn's ``TfidfVectorizer``);

and one value per coordinate for

* ``rmsprop``: mean gradients :math:`\hat g_b` of public batches at the current model,
  ``epoch`` estimator :math:`v = \frac1B \sum_b \hat g_b^2` (the paper code, re-estimated per pass),
  ``recurrence`` :math:`v_b = \beta_b v_{b-1} + (1-\beta_b)\hat g_b^2` (Eqs. 3-4; :math:`\beta_b = 1 - 1/b`
  makes it the running mean, i.e. the epoch estimator), then :math:`A = \sqrt{v + \epsilon}` (code)
  or :math:`\sqrt v + \epsilon` (Eq. 5).

Privacy (invariant 10): every builder here takes only public inputs: the vocabulary statistics file
(TFF's word counts, common knowledge as in the paper), the public pool of held-out users, and the
released model. None reads a training client's data, so A costs no privacy. Its provenance (source,
settings, input files and their identity, pool size, the released round it was estimated at, a
digest of A) is written with the run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

ADADPS_STREAM = 0x616461647073  # "adadps": the public batches' order, disjoint from other seeded streams


@dataclass(frozen=True)
class SideInformation:
    """``A`` per parameter name (tensors broadcastable to the parameter; absent = 1) and where it came from."""

    tensors: dict[str, torch.Tensor]
    provenance: dict[str, Any] = field(default_factory=dict)

    def digest(self) -> str:
        """SHA-256 over the names, shapes and float32 bytes of A (recorded as its provenance)."""
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            t = self.tensors[name].detach().to("cpu", torch.float32).contiguous()
            h.update(f"{name}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def summary(self) -> dict[str, Any]:
        """Provenance plus digest and the range of each tensor (for ``side_information.json``)."""
        return {**self.provenance, "sha256": self.digest(),
                "tensors": {name: {"shape": list(t.shape), "min": float(t.min()), "max": float(t.max()),
                                   "mean": float(t.float().mean())} for name, t in sorted(self.tensors.items())}}


def two_level(vocab_size: int, top: int, multiplier: float) -> torch.Tensor:
    """``(V, 1)``: A = 1 for the ``top`` most frequent words, ``1 / multiplier`` for the rest."""
    a = torch.full((vocab_size, 1), 1.0 / multiplier)
    a[:top] = 1.0
    return a


def by_frequency(counts: np.ndarray, cap: float) -> torch.Tensor:
    """``(V, 1)``: A proportional to frequency, :math:`\\max(n_j / \\max n,\\ 1 / \\mathrm{cap})`."""
    counts = np.asarray(counts, dtype=np.float64)
    top = counts.max() if counts.size else 0.0
    if top <= 0:
        raise ValueError("frequency side information needs at least one positive count")
    return torch.from_numpy(np.maximum(counts / top, 1.0 / cap)).float()[:, None]


def inverse_tfidf(documents: sp.csr_matrix, cap: float) -> torch.Tensor:
    """``(V, 1)``: A inversely proportional to the summed TF-IDF of each word over ``documents``.

    ``documents`` are bags of words (any per-row scaling: the L2 normalisation removes it).
    """
    docs = sp.csr_matrix(documents, dtype=np.float64)
    if docs.shape[0] == 0:
        raise ValueError("tfidf side information needs a non-empty public pool")
    doc_freq = np.bincount(docs.indices, minlength=docs.shape[1])
    idf = np.log((1.0 + docs.shape[0]) / (1.0 + doc_freq)) + 1.0
    weighted = docs @ sp.diags(idf)
    norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(axis=1)).ravel())
    normalised = sp.diags(np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)) @ weighted
    summed = np.asarray(normalised.sum(axis=0)).ravel()
    return torch.from_numpy(1.0 / np.clip(summed, 1.0 / cap, cap)).float()[:, None]


def second_moments(model: nn.Module, batches: Iterable[tuple[Any, Any]],
                   loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], *, estimator: str = "epoch",
                   beta: float | None = None) -> dict[str, torch.Tensor]:
    r"""RMSProp statistics :math:`v` of the public batches' MEAN gradients at ``model``'s weights.

    ``epoch``: :math:`v = \frac1B\sum_b \hat g_b^2`; ``recurrence``: :math:`v_b = \beta_b v_{b-1} +
    (1 - \beta_b)\hat g_b^2` from :math:`v_0 = 0` with :math:`\beta_b` = ``beta`` or :math:`1 - 1/b`.
    The model's weights are not changed (gradients are cleared afterwards).
    """
    params = dict(model.named_parameters())
    v = {name: torch.zeros_like(p) for name, p in params.items()}
    count = 0
    model.train()
    for x, y in batches:
        count += 1
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        decay = (1.0 - 1.0 / count) if estimator == "epoch" or beta is None else beta
        for name, p in params.items():
            grad = p.grad
            assert grad is not None, f"{name} has no gradient after backward()"
            g = grad.to_dense() if grad.is_sparse else grad
            v[name].mul_(decay).addcmul_(g, g, value=1.0 - decay)
    model.zero_grad(set_to_none=True)
    if count == 0:
        raise ValueError("rmsprop side information needs at least one public batch")
    return v


def rmsprop_preconditioner(v: torch.Tensor, eps: float, inside_sqrt: bool) -> torch.Tensor:
    """:math:`A = \\sqrt{v + \\epsilon}` (paper code) or :math:`\\sqrt v + \\epsilon` (paper, Eq. 5)."""
    return (v + eps).sqrt() if inside_sqrt else v.sqrt() + eps


def public_batches(features: sp.csr_matrix, targets: Any, batch_size: int,
                   rng: np.random.Generator) -> Iterable[tuple[sp.csr_matrix, Any]]:
    """One pass over the public pool in a seeded random order, ``batch_size`` posts per batch (last may be short)."""
    order = rng.permutation(features.shape[0])
    for lo in range(0, len(order), batch_size):
        idx = np.sort(order[lo:lo + batch_size])
        yield features[idx], targets[idx]


class AdaDPSOptimizer:
    r"""Any ``torch.optim`` optimizer with AdaDPS's public preconditioner: every step first divides each
    parameter's gradient by its ``A`` (Li et al. 2022, arXiv:2202.05963v2, App. B, Alg. 3:
    :math:`w \leftarrow w - \eta_l\, \nabla f(w) \oslash A` for SGD), then takes the wrapped step.

    For the local steps of federated AdaDPS (user-level DP: the server clips and noises the delta).
    ``A = 1`` is the wrapped optimizer bit for bit; with SGD, ``A -> cA`` equals ``lr -> lr / c``.
    ``A`` must be public (invariant 10): e.g. the side information fedprivacy's server broadcasts.

    Args:
        optimizer: the wrapped optimizer.
        preconditioner: one positive tensor per parameter of ``optimizer``'s groups, in order,
            broadcastable to the parameter's shape.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, preconditioner: Iterable[torch.Tensor]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        a = [torch.as_tensor(t, dtype=p.dtype, device=p.device) for t, p in zip(preconditioner, params, strict=True)]
        for t, p in zip(a, params):
            if torch.broadcast_shapes(t.shape, p.shape) != p.shape or not bool((t > 0).all()):
                raise ValueError(f"preconditioner of shape {tuple(t.shape)} must be positive and broadcast to the "
                                 f"parameter's shape {tuple(p.shape)}")
        self.optimizer, self.params, self.preconditioner = optimizer, params, a

    def step(self, closure=None):
        """Divide the gradients by ``A`` in place, then the wrapped step (``closure`` as torch's)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for p, a in zip(self.params, self.preconditioner):
                if p.grad is not None:
                    p.grad.div_(a)
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
