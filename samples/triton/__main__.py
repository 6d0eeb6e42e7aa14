"""Serve an engine through Triton Inference Server in the TensorRT-LLM backend's shape: models
`tensorrt_llm` (a GptManager driven through its four callbacks), `preprocessing`, `postprocessing`
and `ensemble` (text in, text out), the backend's metrics on the metrics port. Runs in the
foreground until SIGINT / SIGTERM (then live requests end with what they have, waiting ones get
an error, and the server exits). Exit code: 0 for a clean stop; the server's status (128 + N for
a signal N) when it failed; 124 when it was killed, still running 30 s past its exit timeout.

    python -m samples.triton [--engine-dir DIR] [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
                             [--model-repository DIR] [--exit-timeout-s 20] [--setup-only]
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile

from samples.default_model import model_from_arguments
from samples.triton.environment import TritonUnavailableError, prepare, unsupported_reason
from samples.triton.repository import RepositoryOptions, write_repository
from samples.triton.server import EXIT_TIMEOUT_S, Ports, TritonServer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", help="engine, checkpoint or GGUF directory (default: the samples' default model)")
    p.add_argument("--random-model", action="store_true", help="the random-weight model (no tokenizer: no ensemble)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", help="write the repository here (default: a temporary directory)")
    p.add_argument("--max-tokens-in-paged-kv-cache", type=int)
    p.add_argument("--batch-scheduler-policy", default="guaranteed_no_evict",
                   choices=["guaranteed_no_evict", "max_utilization", "static_batch"])
    p.add_argument("--exit-timeout-s", type=int, default=EXIT_TIMEOUT_S,
                   help="Triton's exit timeout: how long it waits for requests in flight once stopped")
    p.add_argument("--setup-only", action="store_true", help="prepare the Triton server's files and exit")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.setup_only and unsupported_reason():   # nothing to prepare; the Triton tests skip here
        print(f"Triton cannot run here: {unsupported_reason()}")
        return 0
    try:
        env = prepare()
    except TritonUnavailableError as e:
        print(f"Triton cannot run here: {e}", file=sys.stderr)
        return 1
    if args.setup_only:
        print(f"Triton server ready to run: {env.server_binary}")
        return 0
    engine_dir = model_from_arguments(args.engine_dir, args.random_model)
    repository = args.model_repository or tempfile.mkdtemp(prefix="triton-repository-")
    options = RepositoryOptions(max_tokens_in_paged_kv_cache=args.max_tokens_in_paged_kv_cache,
                                batch_scheduler_policy=args.batch_scheduler_policy)
    models = write_repository(repository, engine_dir, env.python_path, options)
    print(f"model repository {repository}: {', '.join(models)} (engine {engine_dir})", flush=True)
    server = TritonServer(env, repository, Ports(args.http_port, args.grpc_port, args.metrics_port),
                          exit_timeout_s=args.exit_timeout_s)
    signal.signal(signal.SIGINT, lambda _signum, _frame: server.request_stop())
    signal.signal(signal.SIGTERM, lambda _signum, _frame: server.request_stop())
    try:
        server.wait_ready(models)
        print(f"serving: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}", flush=True)
    except (RuntimeError, TimeoutError) as e:
        if server.is_stopping:   # a signal during the start: a stop, not a failure
            return server.stop()
        print(f"tritonserver failed: {e}", file=sys.stderr)
        return server.stop() or 1
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
