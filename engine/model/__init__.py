"""Llama-family model: config, loading from Hugging Face folders, and the forward pass."""
