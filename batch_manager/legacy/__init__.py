"""The legacy door: GptManager, its InferenceRequest tensors, callbacks, responses."""
