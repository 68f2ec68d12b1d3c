"""Handwritten digits under user-level DP: a Flower App on fedprivacy's DPFedAvg strategy."""
