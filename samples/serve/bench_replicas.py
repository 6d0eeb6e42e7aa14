"""Multi-turn chat through vllm-router in front of N replicas of the serving sample
(samples.serve.replicas), one run per routing policy on the same workload.

    python -m samples.serve.bench_replicas                    # the issue's workload, the default model
    python -m samples.serve.bench_replicas --conversations 24 --rate 0.5 --policies kv_aware,round_robin

Workload: S system prompts (passages of Python's documentation), C conversations, conversation c
with system prompt c mod S and T user turns (short questions); conversations start on a Poisson
process (--rate per second) and send each turn once the reply to the previous one is complete,
that reply kept in the history. Every reply is exactly --max-tokens tokens (greedy, ignore_eos),
so every policy does the same generation work. Each policy gets fresh replicas (cold caches).
Figures per policy: the reused prompt share (prompt tokens whose KV a replica took from its
prefix cache: reused blocks x tokens per block, over every prompt token), the context tokens
computed (the replicas' counters), TTFT p50/p90 (the first streamed content, at the client),
throughput (requests and generated tokens per second, first arrival to last reply), the requests
each replica served.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import aiohttp

from samples.benchmark.report import percentile
from samples.default_model import add_model_arguments, model_from_arguments
from samples.real_text import QUESTIONS, passages
from samples.serve.replicas import POLICIES, Replicas, free_ports, tokens_per_block

MODEL_NAME = "bench"
COUNTERS = {"reused_blocks": "nv_trt_llm_kv_cache_reused_blocks_total",
            "context_tokens": "nv_trt_llm_context_tokens_computed_total",
            "requests": "nv_trt_llm_e2e_request_latency_seconds_count"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, "--engine-dir")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory's; the stand-in "
                                       "tokenizer with --random-model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="kv_aware,round_robin,cache_aware",
                   help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-prompt-chars", type=int, default=1500, help="each system prompt's length")
    p.add_argument("--conversations", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rate", type=float, default=1.0, help="conversations started per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=32, help="every reply's length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", default="gpt_manager", choices=["gpt_manager", "executor"])
    p.add_argument("--log-dir", help="the replicas' and the router's logs (default: temporary directories)")
    p.add_argument("--output-json", metavar="PATH")
    return p.parse_args(argv)


def workload(args) -> tuple[list[str], list[tuple[float, int, list[str]]]]:
    """(system prompts, per conversation (start s, system prompt index, user turns))."""
    rng = random.Random(args.seed)
    systems = [f"You are an assistant for this part of Python's documentation ({topic}):\n\n{text}"
               for topic, text in passages(args.system_prompts, args.system_prompt_chars)]
    conversations, start_s = [], 0.0
    for c in range(args.conversations):
        start_s += rng.expovariate(args.rate)
        conversations.append((start_s, c % len(systems), [rng.choice(QUESTIONS) for _ in range(args.turns)]))
    return systems, conversations


async def read_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    values = {}
    for line in text.splitlines():
        for key, name in COUNTERS.items():
            if line.startswith(name + "{"):
                values[key] = float(line.split()[-1])
    return values


async def chat_turn(session, router_url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: TTFT (s), the reply's text, the prompt and generated tokens."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft_s, pieces, usage = None, [], None
    async with session.post(router_url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"chat request failed: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - start
                    pieces.append(content)
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft_s, "text": "".join(pieces), "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"], "end_s": time.perf_counter()}


async def run_conversations(router_url: str, systems: list[str], conversations, max_tokens: int) -> tuple[list, float]:
    """Every turn's result, and the time from the first arrival to the last reply (s)."""
    results: list[dict] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()

        async def conversation(start_s: float, system: int, questions: list[str]) -> None:
            await asyncio.sleep(max(0.0, t0 + start_s - time.perf_counter()))
            messages = [{"role": "system", "content": systems[system]}]
            for question in questions:
                messages.append({"role": "user", "content": question})
                turn = await chat_turn(session, router_url, messages, max_tokens)
                results.append(turn)
                messages.append({"role": "assistant", "content": turn["text"]})

        await asyncio.gather(*(conversation(*c) for c in conversations))
        first_s = t0 + conversations[0][0]
        return results, max(r["end_s"] for r in results) - first_s


async def measure(replicas: Replicas, systems, conversations, max_tokens: int, tpb: int) -> dict:
    async with aiohttp.ClientSession() as session:
        for r in replicas.replicas:   # untimed: the first request of a process (kernels, caches)
            await chat_turn(session, r.url, [{"role": "user", "content": "Hi"}], 2)
        before = [await read_counters(session, r.url) for r in replicas.replicas]
    results, total_s = await run_conversations(replicas.router_url, systems, conversations, max_tokens)
    async with aiohttp.ClientSession() as session:
        after = [await read_counters(session, r.url) for r in replicas.replicas]
    delta = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    reused_tokens = sum(d["reused_blocks"] for d in delta) * tpb
    ttfts = sorted(r["ttft_s"] * 1000 for r in results)
    return {"requests": len(results), "prompt_tokens": prompt_tokens, "reused_prompt_share": reused_tokens / prompt_tokens,
            "context_tokens_computed": int(sum(d["context_tokens"] for d in delta)),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
            "requests_per_s": len(results) / total_s,
            "generated_tokens_per_s": sum(r["completion_tokens"] for r in results) / total_s,
            "requests_per_replica": [int(d["requests"]) for d in delta], "total_s": total_s}


def tokenizer_of(args, model_dir: str) -> str | None:
    if args.tokenizer is not None:
        return args.tokenizer
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return model_dir
    return "default" if args.random_model else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = model_from_arguments(args.engine_dir, args.random_model)
    tokenizer = tokenizer_of(args, model_dir)
    if tokenizer is None:
        raise SystemExit("error: the chat workload needs a tokenizer with a chat template: pass --tokenizer DIR")
    systems, conversations = workload(args)
    tpb = tokens_per_block(model_dir)
    print(f"{args.replicas} replicas, {len(systems)} system prompts, {args.conversations} conversations x "
          f"{args.turns} turns at {args.rate}/s, replies of {args.max_tokens} tokens, {tpb} tokens per block",
          flush=True)
    report = {}
    for policy in args.policies.split(","):
        [port] = free_ports(1)
        log_dir = os.path.join(args.log_dir, policy) if args.log_dir else None
        with Replicas(model_dir, args.replicas, port, policy, tokenizer, ["--api", args.api, "--log-level", "warning"],
                      log_dir, MODEL_NAME) as replicas:
            report[policy] = asyncio.run(measure(replicas, systems, conversations, args.max_tokens, tpb))
        r = report[policy]
        print(f"{policy:12s} reused prompt share {r['reused_prompt_share']:6.1%}  context tokens computed "
              f"{r['context_tokens_computed']:8d} (of {r['prompt_tokens']})  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  "
              f"p90 {r['ttft_p90_ms']:8.1f} ms  {r['requests_per_s']:.2f} req/s  "
              f"{r['generated_tokens_per_s']:.1f} tok/s  per replica {r['requests_per_replica']}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": report}, f, indent=2)


if __name__ == "__main__":
    main()
