"""pretrain: GPT pretraining with DeepSpeed, from one CPU to multi-node GPU clusters, with one config."""

__version__ = "0.1.0"
