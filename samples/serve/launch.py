"""`python -m samples.serve`'s command line (see samples.serve.server for the routes): the
arguments, the model and tokenizer they name, the bridge (GptManager or Executor) built from them,
and the serving process, which runs until SIGINT or SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal

from batch_manager import KvEventsConfig, SchedulerPolicy, TrtGptModelType
from samples.benchmark.ours import MODEL_TYPES, optional_params
from samples.default_model import add_model_arguments, model_from_arguments
from samples.serve.bridge import ManagerBridge
from samples.serve.generation_config import end_ids, guided_decoding_config
from samples.serve.metrics import TritonMetrics
from samples.serve.openai_basics import MAX_SAMPLES_PER_REQUEST, ModelInfo
from samples.serve.server import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, start_server
from samples.serve.tool_calls import detect_format

logger = logging.getLogger(__name__)


def model_info(model_dir: str, tokenizer, name: str, can_guide: bool = False,
               tokenizer_dir: str | None = None) -> ModelInfo:
    """The OpenAI endpoints' view of the model: its vocabulary and context from the engine or
    checkpoint directory (no weights read), the end ids from its generation config (else the
    tokenizer's), the tool call format from its chat template. can_guide: the engine was given a
    GuidedDecodingConfig (tools need it)."""
    from samples.benchmark.cli import model_limits
    cfg, max_seq_len = model_limits(model_dir)
    ends = end_ids([model_dir, tokenizer_dir], tokenizer, cfg.vocab_size)
    return ModelInfo(name, tokenizer, cfg.vocab_size, max_seq_len, ends[0] if ends else None, ends[1:], can_guide,
                     detect_format(getattr(tokenizer, "chat_template", None)),
                     min(MAX_SAMPLES_PER_REQUEST, _max_batch_size(model_dir)))


def _max_batch_size(model_dir: str) -> int:
    """The engine's max_batch_size (engine.json; a checkpoint directory gets the default build's)."""
    from runtime.config import BuildConfig, read_json
    engine_json = os.path.join(model_dir, "engine.json")
    if os.path.exists(engine_json):
        value = read_json(engine_json, "engine.json").get("build", {}).get("max_batch_size")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return BuildConfig.max_batch_size


def make_bridge(args, model_dir: str, guided_config=None):
    """guided_config: the engine's GuidedDecodingConfig (tools), or None."""
    model_type = MODEL_TYPES[args.type]
    metrics = TritonMetrics(model_type == TrtGptModelType.V1, model=args.model_name,
                            served_model_name=args.served_model_name or os.path.basename(os.path.normpath(model_dir)))
    if args.api == "executor":
        from samples.benchmark.executor import executor_config
        from samples.serve.executor_bridge import ExecutorBridge
        config = executor_config(args)
        config.max_beam_width = args.max_beam_width
        config.max_queue_size, config.max_num_queued_tokens = args.max_queue_size, args.max_num_queued_tokens
        config.guided_decoding_config = guided_config
        return ExecutorBridge(model_dir, _with_kv_cache_options(args, config), metrics, args.ttft_budget_ms)
    params = optional_params(args)
    params.guided_decoding_config = guided_config
    return ManagerBridge(model_dir, model_type, args.max_beam_width,
                         SchedulerPolicy[args.scheduler_policy.upper()],
                         _with_kv_cache_options(args, params), metrics, args.max_queue_size,
                         args.max_num_queued_tokens, args.ttft_budget_ms)


def _with_kv_cache_options(args, config):
    """Block reuse and the KV events publisher on an ExecutorConfig or TrtGptModelOptionalParams."""
    if args.enable_block_reuse or args.kv_events_endpoint is not None:
        config.kv_cache_config.enable_block_reuse = True
    if args.kv_events_endpoint is not None:
        config.kv_events_config = KvEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint)
    elif args.kv_events_replay_endpoint is not None:
        raise SystemExit("--kv-events-replay-endpoint needs --kv-events-endpoint")
    return config


def load_tokenizer(directory: str | None):
    """A local Hugging Face tokenizer directory; "default": the random-weight model's (written on first use)."""
    if directory is None:
        return None
    if directory == "default":
        from samples.serve.default_tokenizer import default_tokenizer_dir
        directory = default_tokenizer_dir()
    import transformers
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tokenizer_dir_of(args, model_dir: str) -> str | None:
    """--tokenizer, else the model directory when it holds a tokenizer (the real default model's
    does), else the stand-in tokenizer when serving the random-weight default model."""
    if args.tokenizer is not None:
        return args.tokenizer
    if any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return model_dir
    if args.engine_dir is None and args.random_model:
        return "default"
    return None


def resolve_host(args) -> tuple[str, str]:
    """(host to bind, the start-up notice about keys and reachability)."""
    if args.api_key is None:
        if args.host is None:
            return "127.0.0.1", (f"no API key (--api-key or ${API_KEY_ENV}): listening on loopback only; "
                                 f"pass --host to listen elsewhere without one")
        if not ipaddress.ip_address(_resolvable(args.host)).is_loopback:
            return args.host, (f"no API key (--api-key or ${API_KEY_ENV}) and --host {args.host}: anyone who "
                               f"can reach this address may use the server")
        return args.host, f"no API key (--api-key or ${API_KEY_ENV}): listening on {args.host}"
    host = args.host if args.host is not None else "0.0.0.0"
    return host, f"API key set: /generate and /v1/* need 'Authorization: Bearer <key>'; listening on {host}"


def _resolvable(host: str) -> str:
    """An address literal for the loopback check ("localhost" is loopback; other names are not)."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return "0.0.0.0"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, "--engine-dir")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizer directory, or \"default\" (the random-weight "
                                       "model's stand-in): enables \"text\" and the OpenAI endpoints (default: the "
                                       "model directory's tokenizer if it has one; the stand-in with --random-model)")
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1 without an API key, 0.0.0.0 with one)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"bearer token required on /generate and /v1/* (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", help="the `model` of the OpenAI endpoints (default: the model "
                                               "directory's name)")
    p.add_argument("--max-queue-size", type=_positive_int, help="requests waiting for the engine beyond which new ones "
                                                      "get 429 (default: unbounded)")
    p.add_argument("--max-num-queued-tokens", type=_positive_int,
                   help="prompt tokens waiting for the engine beyond which new requests get 429 (default: unbounded)")
    p.add_argument("--ttft-budget-ms", type=_positive_float,
                   help="refuse at once (429) a request whose predicted time to first token exceeds this "
                        "(measured context throughput; default: no budget)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--api", default="gpt_manager", choices=["gpt_manager", "executor"],
                   help="the front-end the handlers use: GptManager's callbacks or the Executor's queues")
    p.add_argument("--type", default="IFB", choices=sorted(MODEL_TYPES))
    p.add_argument("--scheduler-policy", default="guaranteed_no_evict",
                   choices=["guaranteed_no_evict", "max_utilization", "static_batch"])
    p.add_argument("--max-beam-width", type=int, default=1)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-num-tokens", type=int)
    p.add_argument("--max-tokens-in-paged-kvcache", type=int)
    p.add_argument("--max-decode-steps", type=int, default=1, metavar="N",
                   help="up to N generation steps per iteration while every request is plain greedy "
                        "(DecodingConfig.max_decode_steps; default 1)")
    p.add_argument("--kv-cache-free-gpu-mem-fraction", type=float)
    p.add_argument("--default-max-new-tokens", type=int, default=64)
    p.add_argument("--enable-block-reuse", action="store_true",
                   help="keep computed KV blocks for later requests sharing their prefix")
    p.add_argument("--kv-events-endpoint", help="publish KV-cache events here in vLLM's format (ZMQ PUB binds, "
                                                "e.g. tcp://127.0.0.1:5557); turns block reuse on")
    p.add_argument("--kv-events-replay-endpoint", help="a ZMQ ROUTER endpoint resending missed KV-event messages")
    p.add_argument("--model-name", default="tensorrt_llm", help="the `model` label of the metrics")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info logs every request (aiohttp's access log)")
    return p.parse_args(argv)


async def _serve(args) -> None:
    model_dir = model_from_arguments(args.engine_dir, args.random_model)
    tokenizer_dir = tokenizer_dir_of(args, model_dir)
    if tokenizer_dir == "default":
        from samples.serve.default_tokenizer import default_tokenizer_dir
        tokenizer_dir = default_tokenizer_dir()
    tokenizer = load_tokenizer(tokenizer_dir)
    name = args.served_model_name or os.path.basename(os.path.normpath(model_dir))
    guided = None
    info = None
    if tokenizer is not None:
        from samples.benchmark.cli import model_limits
        vocab_size = model_limits(model_dir)[0].vocab_size
        ends = end_ids([model_dir, tokenizer_dir], tokenizer, vocab_size)
        guided = guided_decoding_config(tokenizer_dir, ends, vocab_size)
        info = model_info(model_dir, tokenizer, name, guided is not None, tokenizer_dir)
    host, notice = resolve_host(args)
    bridge = make_bridge(args, model_dir, guided)
    runner, port = await start_server(bridge, host, args.port, tokenizer, args.default_max_new_tokens,
                                      model_info=info, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    logger.warning(notice)
    logger.info("OpenAI endpoints: %s", f"model {name!r}" if info is not None else "off (no tokenizer)")
    print(f"listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        bridge.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
