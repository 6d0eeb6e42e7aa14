"""Per-iteration statistics: the legacy JSON keys, serialised with orjson (plain values only)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import orjson


@dataclass
class IterationStats:
    iteration: int
    num_active: int
    max_num_requests: int
    cpu_memory_bytes: int
    gpu_memory_bytes: int
    pinned_memory_bytes: int
    max_blocks: int
    free_blocks: int
    used_blocks: int
    tokens_per_block: int
    allocated_total_blocks: int
    allocated_new_blocks: int
    reused_blocks: int
    num_scheduled: int
    num_context: int
    num_generation: int
    num_context_tokens: int
    num_generation_tokens: int
    num_paused: int
    num_empty_generation_slots: int = 0
    micro_batch_id: int = 0
    num_lora_adapters: int = 0      # adapters in the PEFT cache (host level)
    num_lora_evictions: int = 0     # adapters dropped from the cache so far
    # Cumulative draft tokens verified and accepted; None when drafts are off (keys left out).
    num_draft_tokens_proposed: int | None = None
    num_draft_tokens_accepted: int | None = None
    # Cumulative KV-event messages published (message 0 included) and those a subscriber could not
    # take; None without kv_events_config (keys left out).
    num_kv_events_published: int | None = None
    num_kv_events_dropped: int | None = None


def stats_json(s: IterationStats, is_static_batching: bool) -> str:
    d = {
        "Timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
        "Iteration Counter": s.iteration,
        "Active Request Count": s.num_active,
        "Max Request Count": s.max_num_requests,
        "Runtime CPU Memory Usage": s.cpu_memory_bytes,
        "Runtime GPU Memory Usage": s.gpu_memory_bytes,
        "Runtime Pinned Memory Usage": s.pinned_memory_bytes,
        "Max KV cache blocks": s.max_blocks,
        "Free KV cache blocks": s.free_blocks,
        "Used KV cache blocks": s.used_blocks,
        "Tokens per KV cache block": s.tokens_per_block,
        "Allocated total KV cache blocks": s.allocated_total_blocks,
        "Allocated new KV cache blocks": s.allocated_new_blocks,
        "Reused KV cache blocks": s.reused_blocks,
        "LoRA Adapters Cached": s.num_lora_adapters,
        "LoRA Adapter Evictions": s.num_lora_evictions,
    }
    if is_static_batching:
        d.update({"Scheduled Requests": s.num_scheduled, "Context Requests": s.num_context,
                  "Total Generation Tokens": s.num_generation_tokens, "Total Context Tokens": s.num_context_tokens,
                  "Empty Generation Slots": s.num_empty_generation_slots})
    else:
        d.update({"Scheduled Requests": s.num_scheduled, "Context Requests": s.num_context,
                  "Generation Requests": s.num_generation, "Total Context Tokens": s.num_context_tokens,
                  "MicroBatch ID": s.micro_batch_id, "Paused Requests": s.num_paused})
    if s.num_draft_tokens_proposed is not None:
        d.update({"Draft Tokens Proposed": s.num_draft_tokens_proposed,
                  "Draft Tokens Accepted": s.num_draft_tokens_accepted})
    if s.num_kv_events_dropped is not None:
        d["KV Events Published"] = s.num_kv_events_published
        d["KV Events Dropped"] = s.num_kv_events_dropped
    return orjson.dumps(d).decode()
