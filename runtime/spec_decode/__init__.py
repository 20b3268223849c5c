"""Speculative decoding: drafters propose tokens, the target verifies them in one forward pass."""
