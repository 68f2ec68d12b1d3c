"""Handwritten digits by writer, from local Parquet through Flower Datasets, under fedprivacy's DPFedAvg."""
