"""Multi-LoRA serving inside the engine: adapter slots, the host tier, and per-step batches."""
