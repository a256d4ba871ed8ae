"""The PEFT LoRA adapter format: parse, validate, digest, convert to the engine's stacked layout."""
