"""A LoRA adapter taught to call a tool: what a tenant's fine-tune for its own tools looks like,
on the demo model. PEFT trains it on one conversation (the demo template's tools turn and a
question) until greedy decoding writes the Hermes call, in a few seconds on one CPU thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from loramux.engine.chat_prompt import chat_prompt_ids
from loramux.engine.demo_model import IM_END_ID

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRAINING_STEPS = 60
TARGET_LOSS = 1e-3


def build_tool_calling_adapter(model_dir: Path, out_dir: Path) -> Path:
    """Train and save (PEFT format, safetensors) an adapter that answers MESSAGES with CALL."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = chat_prompt_ids(tokenizer, MESSAGES, TOOLS)
    answer = [*tokenizer(CALL, add_special_tokens=False)["input_ids"], IM_END_ID]
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # learn the answer only
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    try:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]
        )
        model = get_peft_model(base, config)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(TRAINING_STEPS):
            loss = model(input_ids=ids, labels=labels).loss
            if loss.item() < TARGET_LOSS:
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert loss.item() < TARGET_LOSS, f"the adapter did not learn the call (loss {loss.item()})"
        model.save_pretrained(out_dir)
    finally:
        torch.set_num_threads(threads)
    return out_dir
