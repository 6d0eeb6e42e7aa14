"""In-flight batching manager in the shape of TensorRT-LLM's GptManager."""
