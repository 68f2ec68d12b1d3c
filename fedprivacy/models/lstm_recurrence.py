"""One LSTM layer's recurrence with backpropagation through time written out, ``vmap``-able.

``aten::lstm`` (``torch.nn.LSTM``) has no ``vmap`` batching rule; :class:`LSTMRecurrence` computes the
same layer from its input projections in plain tensor ops, so a model built on it can run many
clients' parameters at once (:meth:`fedprivacy.models.lstm.NextWordLSTM.vmap_forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


class LSTMRecurrence(torch.autograd.Function):
    """One LSTM layer's recurrence from its input projections, with backpropagation through time
    written out (``vmap``-able: ``generate_vmap_rule``).

    .. math:: (i, f, g, o) = z_t + h_{t-1} W_{hh}^\\top + b_{hh},\\quad
              c_t = \\sigma(f) c_{t-1} + \\sigma(i) \\tanh(g),\\quad h_t = \\sigma(o) \\tanh(c_t)

    with :math:`z_t = x_t W_{ih}^\\top + b_{ih}` given and :math:`h_0 = c_0 = 0` (the equations of
    ``torch.nn.LSTM``, gate order ``i, f, g, o``). Autograd through the loop would form
    :math:`\\partial W_{hh}` as a sum of ``seq_len`` rank-``batch`` products; the backward here
    forms it as one product over all steps, :math:`\\sum_t \\delta z_t^\\top h_{t-1}`, as the
    fused ``aten::lstm`` kernel does (2.4x faster for the next-word LSTM's recurrence).
    ``forward(z (batch, seq_len, 4H), W_hh (4H, H), b_hh (4H)) -> (h, c, activated gates)``,
    each per step; only ``h`` is differentiable.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(inputs: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor):
        h = c = inputs.new_zeros(inputs.shape[0], w_hh.shape[1])
        hidden, cells, gates = [], [], []
        for t in range(inputs.shape[1]):
            i, f, g, o = (inputs[:, t] + F.linear(h, w_hh, b_hh)).chunk(4, dim=1)
            i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
            c = f * c + i * g
            h = o * torch.tanh(c)
            hidden.append(h)
            cells.append(c)
            gates.append(torch.cat([i, f, g, o], dim=1))
        return torch.stack(hidden, 1), torch.stack(cells, 1), torch.stack(gates, 1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        hidden, cells, gates = output
        ctx.save_for_backward(inputs[1], hidden, cells, gates)
        ctx.mark_non_differentiable(cells, gates)

    @staticmethod
    def backward(ctx: Any, d_hidden: torch.Tensor, _d_cells: torch.Tensor, _d_gates: torch.Tensor):
        w_hh, hidden, cells, gates = ctx.saved_tensors
        steps, size = hidden.shape[1], hidden.shape[2]
        i, f, g, o = gates.chunk(4, dim=2)
        tanh_c = torch.tanh(cells)
        dh = dc = hidden.new_zeros(hidden.shape[0], size)
        dz = [None] * steps
        for t in reversed(range(steps)):
            dh = d_hidden[:, t] + dh
            dc = dc + dh * o[:, t] * (1 - tanh_c[:, t] ** 2)
            c_prev = cells[:, t - 1] if t else torch.zeros_like(dc)
            it, ft, gt, ot = i[:, t], f[:, t], g[:, t], o[:, t]
            dz[t] = torch.cat([dc * gt * it * (1 - it), dc * c_prev * ft * (1 - ft), dc * it * (1 - gt ** 2),
                               dh * tanh_c[:, t] * ot * (1 - ot)], dim=1)
            dc = dc * ft
            dh = dz[t] @ w_hh
        dz = torch.stack(dz, 1)
        h_prev = torch.cat([hidden.new_zeros(hidden.shape[0], 1, size), hidden[:, :-1]], dim=1)
        return dz, dz.flatten(0, 1).t() @ h_prev.flatten(0, 1), dz.sum((0, 1))
