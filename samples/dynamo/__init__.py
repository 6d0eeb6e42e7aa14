"""The engine as an NVIDIA Dynamo 1.6.1 backend: `python -m samples.dynamo` (Dynamo's OpenAI
frontend and N workers), `python -m samples.dynamo.worker` (one worker). Importing this package
imports nothing of Dynamo: `samples.dynamo.engine` needs `ai-dynamo` installed (README)."""
