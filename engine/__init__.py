"""The loramux engine: one base model, paged KV cache, continuous batching, many LoRA adapters."""
