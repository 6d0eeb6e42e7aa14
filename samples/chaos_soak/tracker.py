"""The chaos soak's client (`samples.chaos_soak`): the queue the producer threads fill, the four
user callbacks (each raising at random, as a careless user's would), the fault injector, and the
bookkeeping that checks every response against what its submission expects."""
from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter, deque

from batch_manager import InferenceRequest, tensor_names as tn

from .requests import UNKNOWN_ID_BASE, Submission, make_duplicate

CALLBACK_FAULT_RATE = 0.02   # each callback call raises with this probability
STEP_FAULT_RATE = 0.003      # each step (micro-batch group) raises with this probability
DUPLICATE_RATE = 0.03        # per fetched request: also hand out a duplicate of an active id
STOP_RATE = 0.01             # per stop poll: stop one active request and one unknown id
KEEP_UNEXPECTED = 20
THREAD_GRACE_S = 10.0        # how long a thread a round started may take to end after its shutdown


def threads_started_since(before: set[threading.Thread], grace_s: float = THREAD_GRACE_S) -> list[str]:
    """The threads alive now that were not in `before` (threading.enumerate() then), waiting up to
    grace_s for them to end: each as its name and where it is (its innermost frame), so a leak
    names its culprit. By identity, not by count: a thread of an earlier test (or a library's)
    ending or starting meanwhile neither hides a leak nor fakes one."""
    deadline = time.monotonic() + grace_s
    while True:
        started = [t for t in threading.enumerate() if t not in before]
        if not started or time.monotonic() >= deadline:
            return sorted(_where(t) for t in started)
        started[0].join(max(0.0, deadline - time.monotonic()))


def _where(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    if frame is None:   # ended (or not started) meanwhile
        return thread.name
    return f"{thread.name} at {frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


class InjectedFault(RuntimeError):
    pass


class ChaosClient:
    def __init__(self, seed: int, kv=None):
        self.rng = random.Random(seed)   # used on the worker thread only
        self.fault_rng = random.Random(seed + 1)   # the fault hook's (the forward thread under overlap)
        self.kv = kv                     # the manager's KvCacheManager, checked from the stats callback
        self.lock = threading.Lock()
        self.queue: deque[tuple[InferenceRequest, Submission]] = deque()
        self.active: dict[int, Submission] = {}     # request id -> submission handed out, no final yet
        self.duplicates: Counter[int] = Counter()   # request id -> duplicates handed out, no final yet
        self.free_ids: list[int] = []               # ids whose final response arrived: reusable
        self.next_id = 0
        self.num_fetched = 0
        self.counts: Counter[str] = Counter()
        self.bad_fields: Counter[str] = Counter()   # field -> bad requests handed out
        self.unexpected: list[str] = []
        self.greedy_done: list[tuple[Submission, list[int]]] = []   # (submission, prompt + generated)
        self.num_paused = 0
        self.num_lora_evictions = 0
        self.last_activity_s = time.monotonic()

    # -- producers (any thread) ---------------------------------------------------------------------

    def take_id(self, rng: random.Random) -> int:
        """A fresh id, or (one time in five) one whose final response already came back."""
        with self.lock:
            if self.free_ids and rng.random() < 0.2:
                return self.free_ids.pop(rng.randrange(len(self.free_ids)))
            self.next_id += 1
            return self.next_id

    def submit(self, request: InferenceRequest, submission: Submission) -> None:
        with self.lock:
            self.queue.append((request, submission))

    @property
    def num_queued(self) -> int:
        with self.lock:
            return len(self.queue)

    @property
    def num_outstanding(self) -> int:
        with self.lock:
            return len(self.active) + sum(self.duplicates.values())

    def _unexpected(self, message: str) -> None:
        self.counts["unexpected"] += 1
        if len(self.unexpected) < KEEP_UNEXPECTED:
            self.unexpected.append(message)

    # -- the four callbacks (worker thread) ---------------------------------------------------------

    def get(self, max_num_requests: int) -> list[InferenceRequest]:
        self.last_activity_s = time.monotonic()
        if self.rng.random() < CALLBACK_FAULT_RATE:   # before taking anything: nothing is lost
            raise InjectedFault("get callback fault")
        out = []
        with self.lock:
            while self.queue and len(out) < max_num_requests:
                request, sub = self.queue.popleft()
                out.append(request)
                self._hand_out(sub)
                if len(out) < max_num_requests and self.rng.random() < DUPLICATE_RATE:
                    valid = [i for i, s in self.active.items() if not s.is_bad]
                    if valid:
                        dup, dup_sub = make_duplicate(self.rng, self.rng.choice(valid))
                        out.append(dup)
                        self._hand_out(dup_sub)
        return out

    def _hand_out(self, sub: Submission) -> None:
        self.num_fetched += 1
        self.counts["submitted"] += 1
        self.counts[sub.kind] += 1
        if sub.kind == "bad":
            self.bad_fields[sub.bad_field] += 1
        if sub.kind == "duplicate":
            self.duplicates[sub.request_id] += 1
        elif sub.request_id in self.active:
            self._unexpected(f"request {sub.request_id}: the soak handed out an id still active")
        else:
            self.active[sub.request_id] = sub

    def send(self, request_id, tensors, is_final: bool, err_msg: str) -> None:
        self.last_activity_s = time.monotonic()
        with self.lock:
            self._record(request_id, {t.name: t.tensor for t in tensors}, is_final, err_msg)
        if self.rng.random() < CALLBACK_FAULT_RATE:   # after recording: the manager must carry on
            raise InjectedFault("send callback fault")

    def poll_stop(self) -> set[int]:
        self.last_activity_s = time.monotonic()
        if self.rng.random() < CALLBACK_FAULT_RATE:
            raise InjectedFault("stop callback fault")
        if self.rng.random() >= STOP_RATE:
            return set()
        with self.lock:
            ids = {UNKNOWN_ID_BASE + self.rng.randrange(1000)}
            valid = [i for i, s in self.active.items() if not s.is_bad]
            if valid:
                stopped = self.rng.choice(valid)
                self.active[stopped].is_stopped = True
                ids.add(stopped)
            return ids

    def report_stats(self, stats_json: str) -> None:
        self.last_activity_s = time.monotonic()
        stats = json.loads(stats_json)
        with self.lock:
            self.num_paused += stats.get("Paused Requests", 0)
            self.num_lora_evictions = max(self.num_lora_evictions, stats.get("LoRA Adapter Evictions", 0))
            if stats["Free KV cache blocks"] + stats["Used KV cache blocks"] != stats["Max KV cache blocks"]:
                self._unexpected(f"stats: free + used != max blocks: {stats}")
            if self.kv is not None:   # continuously: the block manager between two iterations
                try:
                    self.kv.check_invariants()
                except AssertionError as e:
                    self._unexpected(f"KV invariant broken during the run: {e}")
        if self.rng.random() < CALLBACK_FAULT_RATE:
            raise InjectedFault("stats callback fault")

    def fault_injector(self, group) -> None:
        """The executor's test hook, called before each forward group (on the forward thread under
        overlap): the group's step raises at random, as a failing step or forward would."""
        self.last_activity_s = time.monotonic()
        if self.fault_rng.random() < 2 * STEP_FAULT_RATE:
            with self.lock:
                for r in group:
                    sub = self.active.get(r.request_id)
                    if sub is not None:
                        sub.is_faulted = True
            raise InjectedFault("injected step fault")

    # -- checking responses -------------------------------------------------------------------------

    def _record(self, request_id, tensors: dict, is_final: bool, err_msg: str) -> None:
        if is_final and "already exists" in err_msg and self.duplicates[request_id] > 0:
            self.duplicates[request_id] -= 1
            self.counts["expected_errors"] += 1
            if tensors or "request_id" not in err_msg:
                self._unexpected(f"request {request_id}: duplicate refused badly: {err_msg!r}")
            return
        sub = self.active.get(request_id)
        if sub is None:
            self._unexpected(f"request {request_id}: a response with no request active ({err_msg!r})")
            return
        sub.num_responses += 1
        if not is_final:
            if sub.is_bad or not sub.is_streaming or err_msg:
                self._unexpected(f"request {request_id}: a non-final response for a {sub.kind} request")
            elif sub.beam_width == 1:
                sub.streamed += tensors[tn.OUTPUT_IDS][0, 0].tolist()
            return
        del self.active[request_id]
        self.free_ids.append(request_id if request_id >= 0 else -1 - request_id)
        if sub.is_bad:
            if not err_msg or tensors or sub.bad_field not in err_msg or sub.num_responses != 1:
                self._unexpected(f"request {request_id}: bad {sub.bad_field} answered with {err_msg!r}")
            else:
                self.counts["expected_errors"] += 1
            return
        if err_msg:
            if sub.is_faulted and "model step" in err_msg:
                self.counts["expected_errors"] += 1
                self.counts["faulted"] += 1
            elif sub.lora_id_only and f"lora_task_id: {sub.lora_task_id} is not in the PEFT cache" in err_msg:
                self.counts["expected_errors"] += 1
                self.counts["lora_uncached"] += 1
            else:
                self._unexpected(f"request {request_id}: valid {sub.kind} request failed: {err_msg!r}")
            return
        self.counts["served"] += 1
        self.counts["stopped"] += sub.is_stopped
        self.counts["lora_served"] += sub.lora_task_id is not None
        self._check_output(sub, tensors)

    def _check_output(self, sub: Submission, tensors: dict) -> None:
        ids, lengths = tensors[tn.OUTPUT_IDS], tensors[tn.SEQUENCE_LENGTH]
        if ids.dim() != 3 or ids.shape[1] != sub.beam_width or list(lengths.shape) != [1, sub.beam_width]:
            self._unexpected(f"request {sub.request_id}: output shape {list(ids.shape)} for {sub.beam_width} beams")
            return
        num_generated = [int(n) - (0 if sub.is_streaming else len(sub.prompt)) for n in lengths[0]]
        if sub.beam_width == 1 and sub.is_streaming:
            num_generated = [len(sub.streamed) + int(lengths[0, 0])]
        if not sub.is_stopped and not all(0 <= n <= sub.max_new_tokens for n in num_generated):
            self._unexpected(f"request {sub.request_id}: generated {num_generated} of {sub.max_new_tokens}")
        if sub.kind != "greedy" or sub.is_stopped or sub.lora_task_id is not None:   # solo reference: no adapters
            return
        if sub.is_streaming:
            tokens = sub.prompt + sub.streamed + ids[0, 0, :int(lengths[0, 0])].tolist()
        else:
            tokens = ids[0, 0, :int(lengths[0, 0])].tolist()
        self.greedy_done.append((sub, tokens))
