"""What every front door shares (GptManager's in `legacy/`, the Executor's in `executor/`, a new one):
the worker's `FrontEnd` protocol, the tensor rendering of a request's output and the stream cursors,
and the tensor checks of a parsed request. Imports no door."""
