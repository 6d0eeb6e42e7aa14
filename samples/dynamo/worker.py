"""`python -m samples.dynamo.worker --engine-dir DIR ...`: one Dynamo worker over the Executor, for
a frontend (and etcd / NATS, or file discovery) run by the user. Dynamo's runtime owns the process:
SIGINT / SIGTERM deregister it, then `ExecutorEngine.cleanup` shuts the Executor down."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from dynamo.common.backend.run import run
    from samples.dynamo.engine import ExecutorEngine
    run(ExecutorEngine, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
