"""The serving benchmark in the manner of the legacy gptManagerBenchmark: datasets and arrivals
(`dataset`), our serving loop through GptManager (`ours`) or the Executor (`executor`), the Hugging
Face baseline (`hf`), reports and plots; `python -m samples.benchmark` runs it (`cli`)."""
