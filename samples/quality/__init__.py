"""`python -m samples.quality`: the real model's quality through our runtime against transformers on
the same weights: perplexity on real text, greedy agreement and sampled log probs on chat prompts,
prompt lookup on a copying workload and a JSON-schema guided answer."""
