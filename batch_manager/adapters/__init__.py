"""LoRA adapters across requests: the PEFT cache and the weights re-sent with requests."""
