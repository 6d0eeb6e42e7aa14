"""The chaos soak: rounds of hostile traffic through GptManager and the Executor (`soak`), the
random requests (`requests`), the client that checks every response (`tracker`) and the Executor
round (`executor_round`); `python -m samples.chaos_soak` runs it."""
