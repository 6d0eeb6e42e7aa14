"""The Dynamo worker's command line -> (`WorkerOptions`, Dynamo's `WorkerConfig`): the engine,
the served name and model card, discovery and planes, KV events, and the role (aggregated, or
Dynamo's prefill / decode over the engine's context-only / generation-only requests: disagg)."""
from __future__ import annotations

import argparse
import os
import random
import socket
from dataclasses import dataclass

from samples.default_model import DEFAULT_CACHE_DIR


@dataclass(frozen=True)
class WorkerOptions:
    engine_dir: str
    served_model_name: str
    card_dir: str                      # the model card the frontend reads (model_card)
    tokenizer_dir: str | None          # None: the engine directory's tokenizer files
    kv_events_port: int | None         # where the KV events publisher binds on 127.0.0.1 (None: off)
    max_batch_size: int | None
    max_kv_tokens: int | None          # the KV pool's size in tokens (None: the engine's default)
    role: str = "agg"                  # "agg", "prefill" (context-only) or "decode" (generation-only)


def free_port(below: int | None = None) -> int:
    """A port free on 127.0.0.1 now; `below`: under that bound (the OS picks from its high range)."""
    if below is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in random.sample(range(20000, below), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port found in 20000..{below - 1}")


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0: a free one), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m samples.dynamo.worker",
                                description="One Dynamo worker over the engine's Executor")
    p.add_argument("--engine-dir", required=True, help="the engine directory (runtime.build's output)")
    p.add_argument("--tokenizer-dir", help="its tokenizer files (default: the engine directory)")
    p.add_argument("--served-model-name", help="the OpenAI `model` (default: the engine directory's name)")
    p.add_argument("--card-dir", help="where the model card the frontend reads is written (default: a cache dir)")
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--discovery-backend", default="file", choices=["file", "etcd", "kubernetes", "mem"])
    p.add_argument("--request-plane", default="tcp", choices=["tcp", "nats", "http"])
    p.add_argument("--event-plane", default=None, choices=["zmq", "nats"])
    p.add_argument("--kv-events-port", type=_port, default=0,
                   help="the KV events publisher's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--disable-kv-routing", action="store_true", help="publish no KV events or load snapshots")
    p.add_argument("--disaggregation-mode", default="agg", choices=["agg", "aggregated", "prefill", "decode"],
                   help="prefill: context-only requests whose KV a decode worker fetches; decode: generation-only")
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-tokens-in-paged-kvcache", type=int, dest="max_kv_tokens")
    return p


def parse_worker_args(argv: list[str] | None = None):
    """-> (WorkerOptions, dynamo WorkerConfig); SystemExit (argparse) for bad arguments."""
    from dynamo.common.backend import WorkerConfig
    from dynamo.common.constants import DisaggregationMode
    args = build_parser().parse_args(argv)
    role = "agg" if args.disaggregation_mode == "aggregated" else args.disaggregation_mode
    engine_dir = os.path.abspath(args.engine_dir)
    name = args.served_model_name or os.path.basename(engine_dir.rstrip("/"))
    card_dir = args.card_dir or os.path.join(os.environ.get("BATCH_MANAGER_CACHE", DEFAULT_CACHE_DIR),
                                             "dynamo-cards", name)
    kv_port = None
    if not args.disable_kv_routing:
        kv_port = args.kv_events_port or free_port()
    options = WorkerOptions(engine_dir, name, card_dir, args.tokenizer_dir, kv_port, args.max_batch_size,
                            args.max_kv_tokens, role)
    config = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                          model_name=card_dir, served_model_name=name, discovery_backend=args.discovery_backend,
                          request_plane=args.request_plane, event_plane=args.event_plane,
                          enable_kv_routing=not args.disable_kv_routing,
                          disaggregation_mode=DisaggregationMode(role))
    return options, config
