"""Per-request additions to the model: LoRA adapters (`lora`, `lora_step`, `peft_adapter`) and prompt tables (`prompt_tuning`)."""
