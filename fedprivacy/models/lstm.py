"""Next-word LSTM of TFF's StackOverflow baseline (Reddi et al. 2021, arXiv:2003.00295, App. C).

.. math:: e_t = E[x_t],\\quad h_t = \\mathrm{LSTM}(e_t, h_{t-1}),\\quad
          p_t = W_2 h_t + b_2,\\quad \\mathrm{logits}_t = W_3 p_t + b_3

with ``E`` of size ``(V + 4) x 96``, one LSTM layer of 670 units, a projection ``670 -> 96`` and
the output layer ``96 -> V + 4`` (TFF ``word_prediction_models.create_recurrent_model``
defaults: ``embedding_size=96``, ``num_lstm_layers=1``, ``lstm_size=670``,
``shared_embedding=False``). For V = 10,000 TFF's Keras model has 4,050,748 parameters; this
one has 2,680 more because PyTorch's LSTM keeps two bias vectors (``b_ih`` and ``b_hh``) where
Keras keeps one. Inputs are int token ids ``(batch, seq_len)``; the output is logits
``(batch, seq_len, V + 4)``. Keras's ``mask_zero`` only affects the loss, which the task
masks itself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedprivacy.models.lstm_recurrence import LSTMRecurrence


class NextWordLSTM(nn.Module):
    """Embedding -> LSTM -> Dense(embedding) -> Dense(classes), as TFF's baseline."""

    def __init__(self, num_classes: int, embedding_size: int = 96, lstm_size: int = 670) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, embedding_size)
        self.lstm = nn.LSTM(embedding_size, lstm_size, batch_first=True)
        self.projection = nn.Linear(lstm_size, embedding_size)
        self.output = nn.Linear(embedding_size, num_classes)

    def forward(self, tokens: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq_len, num_classes)`` for int token ids ``(batch, seq_len)``."""
        device = self.output.weight.device
        x = torch.as_tensor(np.asarray(tokens, dtype=np.int64) if isinstance(tokens, np.ndarray)
                            else tokens).to(device, non_blocking=True).long()  # need not wait for the device
        hidden, _ = self.lstm(self.embedding(x))
        return self.output(self.projection(hidden))

    @staticmethod
    def vmap_forward(params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` as a function of the parameters by name, ``vmap``-able (unlike ``aten::lstm``):
        the LSTM layer runs through :class:`~fedprivacy.models.lstm_recurrence.LSTMRecurrence`. How a
        cohort of this model trains together (:mod:`fedprivacy.client.cohort_training`); a subclass that
        changes :meth:`forward` must change this too. ``tokens``: int ids ``(batch, seq_len)`` (a tensor);
        returns logits ``(batch, seq_len, num_classes)``."""
        embedded = F.embedding(tokens, params["embedding.weight"])
        inputs = F.linear(embedded, params["lstm.weight_ih_l0"], params["lstm.bias_ih_l0"])
        hidden = LSTMRecurrence.apply(inputs, params["lstm.weight_hh_l0"], params["lstm.bias_hh_l0"])[0]
        projected = F.linear(hidden, params["projection.weight"], params["projection.bias"])
        return F.linear(projected, params["output.weight"], params["output.bias"])
