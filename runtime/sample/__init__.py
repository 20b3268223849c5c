"""Turning logits into tokens: sampling parameters (torch-free), their per-step tensors and the batched sampler."""
