"""Triton Inference Server in the TensorRT-LLM backend's shape over GptManager: the model
repository (`repository`), the models the backend stub runs (`llm_model`, `text_models`), the
server's environment and process (`environment`, `server`), a client and the benchmark."""
