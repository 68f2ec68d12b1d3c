"""fedprivacy: federated learning simulations under user-level differential privacy.

Layers (imports point downward only): ``cli``/``run`` -> ``engines`` -> ``fl`` (Flower apps) ->
core (``privacy``, ``optim``, ``client``, ``data``, ``models``; no Flower imports).
"""

__version__ = "0.1.0"
