"""Reading weights: safetensors checkpoints and engine files (`tensor_files`, `weights`) and GGUF files (`gguf_file`, `gguf_checkpoint`, `gguf_archs`, `gguf_tokenizer`)."""
