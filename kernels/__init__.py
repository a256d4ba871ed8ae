"""Triton kernels and their plain-torch twins. Pure functions on tensors; no engine knowledge."""
