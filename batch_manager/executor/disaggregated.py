"""Disaggregated context and generation: the checks of a request's `RequestType` and
`ContextPhaseParams` (request.py) at enqueue and the params a context-only request's final result
carries; `KvTransfer`, one Executor's side of moving the KV: the blocks its context-only requests
leave (kept by the scheduler, served by a TCP thread started with the first such request) and the
fetches of its generation-only requests. Called by the Executor's front end."""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack

from runtime.request import AdmissionLimits, RequestError, RequestOutput, ResumedContext, clamped_new_tokens

from ..kv_transport.kv_handoff import ExportedKv, KvExports
from ..kv_transport.kv_transfer import FetchExpectation, KvTransferServer, OpenSockets, fetch_blocks
from ..kv_transport.kv_wire import KvLayout, is_nested_deeper
from .conversion import _token_ids
from .request import ContextPhaseParams, Request, RequestType, SamplingConfig

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_MAX_FETCHES = 4   # concurrent fetches of one Executor
_MAX_STATE_DEPTH = 4   # containers in containers in opaque_state (a context-only result's has 2)


def prompt_digest(token_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()


def _plain(value) -> Any:
    value = value.item() if hasattr(value, "item") else value
    return int(value) if isinstance(value, bool) else value


def sampling_record(sampling: SamplingConfig) -> dict[str, Any]:
    """SamplingConfig attribute -> its value, unset ones as their defaults (what both sides compare)."""
    return {name: _plain(value) for name, value in sampling.resolved().items()}


@dataclass(frozen=True)
class ContextOnly:
    """What a context-only request's params will record (taken at enqueue)."""
    prompt_len: int
    prompt_digest: bytes
    max_tokens: int                      # the total asked for, before any clamping
    sampling: dict[str, Any]
    lora_task_id: int | None

    def params(self, request_id: int, output: RequestOutput, exported: ExportedKv,
               transfer: "KvTransfer") -> ContextPhaseParams:
        """After its final result: the params of its exported blocks."""
        sequence = output.sequences[0]
        host, port = transfer.serve()
        state = {"version": _STATE_VERSION, "host": host, "port": port, "handle": exported.handle,
                 "num_tokens": exported.num_tokens, "prompt_len": self.prompt_len,
                 "prompt_digest": self.prompt_digest, "max_tokens": self.max_tokens, "sampling": self.sampling,
                 "lora_task_id": self.lora_task_id, "first_log_prob": float(sequence.cum_log_prob),
                 "layout": transfer.layout.to_dict()}
        return ContextPhaseParams(list(sequence.tokens[:1]), request_id, msgpack.packb(state, use_bin_type=True))


@dataclass(frozen=True)
class KvSource:
    """Where a generation-only request fetches its prompt's KV."""
    host: str
    port: int
    handle: int
    num_tokens: int     # the request's prompt length: what the answer must cover


# opaque_state key -> the types its value may have (a context-only result's params; checked at enqueue)
_STATE_FIELDS = {"host": (str,), "port": (int,), "handle": (int,), "num_tokens": (int,), "prompt_len": (int,),
                 "prompt_digest": (bytes,), "max_tokens": (int,), "sampling": (dict,),
                 "lora_task_id": (int, type(None)), "first_log_prob": (float, int), "layout": (dict,)}


def _check_state_fields(state: dict) -> None:
    for name, types in _STATE_FIELDS.items():
        if name not in state:
            raise RequestError(f"context_phase_params: opaque_state.{name} is missing")
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise RequestError(f"context_phase_params: opaque_state.{name}: expected "
                               f"{' or '.join(t.__name__ for t in types)}, got {str(value)[:80]!r}")
    if not 0 < state["port"] < 65536 or not state["host"]:
        raise RequestError(f"context_phase_params: opaque_state.host / port: not an address "
                           f"({state['host'][:80]!r}, {state['port']})")


def check_request_type(request: Request, limits: AdmissionLimits, transfer: "KvTransfer | None"
                       ) -> tuple[RequestType, ContextOnly | ResumedContext | None]:
    """RequestError naming the field for a request its type does not allow. -> (its type, and for a
    context-only request what its params record, for a generation-only one where it resumes)."""
    try:
        request_type = RequestType(getattr(request, "request_type", RequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION))
    except ValueError:
        raise RequestError(f"request_type: expected a RequestType, got {request.request_type!r}") from None
    params = getattr(request, "context_phase_params", None)
    if request_type == RequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION:
        if params is not None:
            raise RequestError("context_phase_params: given with REQUEST_TYPE_CONTEXT_AND_GENERATION (they are for "
                               "REQUEST_TYPE_GENERATION_ONLY)")
        return request_type, None
    _check_disaggregable(request, request_type, transfer)
    lora_task_id = getattr(request.lora_config, "task_id", None)
    if request_type == RequestType.REQUEST_TYPE_CONTEXT_ONLY:
        if params is not None:
            raise RequestError("context_phase_params: given with REQUEST_TYPE_CONTEXT_ONLY (it makes them)")
        transfer.serve()
        prompt = _prompt(request)
        sampling = request.sampling_config
        return request_type, ContextOnly(len(prompt), prompt_digest(prompt), request.max_tokens,
                                         sampling_record(sampling) if isinstance(sampling, SamplingConfig) else {},
                                         lora_task_id)
    return request_type, _resumed(request, params, limits, transfer, lora_task_id)


def _prompt(request: Request) -> list[int]:
    return _token_ids("input_token_ids", request.input_token_ids)


def _check_disaggregable(request: Request, request_type: RequestType, transfer: "KvTransfer | None") -> None:
    name = request_type.name
    if transfer is None or not transfer.is_single_rank:
        layout = "" if transfer is None else (f" (tensor_parallelism {transfer.layout.tensor_parallelism}, "
                                               f"pipeline_parallelism {transfer.layout.pipeline_parallelism})")
        raise RequestError(f"request_type: {name} needs a single-rank executor{layout}")
    sampling = request.sampling_config
    if isinstance(sampling, SamplingConfig) and ((sampling.beam_width or 1) != 1
                                                 or (sampling.num_return_sequences or 1) != 1):
        raise RequestError(f"sampling_config.beam_width: {name} takes one sequence (beam width 1, "
                           f"num_return_sequences 1), got {sampling.beam_width} and {sampling.num_return_sequences}")
    for field, what in (("guided_decoding_params", "a guide"), ("external_draft_tokens_config", "draft tokens")):
        if getattr(request, field, None) is not None:
            raise RequestError(f"{field}: {name} takes no {what}")


def _resumed(request: Request, params, limits: AdmissionLimits, transfer: "KvTransfer",
             lora_task_id: int | None) -> ResumedContext:
    if isinstance(params, (bytes, bytearray)):
        params = ContextPhaseParams.from_bytes(params)
    if not isinstance(params, ContextPhaseParams):
        raise RequestError(f"context_phase_params: REQUEST_TYPE_GENERATION_ONLY needs the ContextPhaseParams of a "
                           f"context-only result, got {type(params).__name__}")
    try:
        state = msgpack.unpackb(params.opaque_state or b"", raw=False)
    except (TypeError, ValueError, msgpack.UnpackException):
        state = None
    if is_nested_deeper(state, _MAX_STATE_DEPTH):
        raise RequestError(f"context_phase_params: opaque_state nests deeper than {_MAX_STATE_DEPTH} levels (not "
                           f"that of a context-only result)")
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
        raise RequestError("context_phase_params: opaque_state is not that of a context-only result of this version")
    _check_state_fields(state)
    mismatch = transfer.layout.mismatch(state.get("layout"))
    if mismatch is not None:
        raise RequestError(f"context_phase_params: the context instance differs from this one in {mismatch}")
    if len(params.first_gen_tokens) != 1 or not 0 <= params.first_gen_tokens[0] < limits.vocab_size:
        raise RequestError(f"context_phase_params.first_gen_tokens: expected one token id in "
                           f"[0, {limits.vocab_size}), got {params.first_gen_tokens!r}")
    prompt = _prompt(request)
    if len(prompt) != state["prompt_len"] or prompt_digest(prompt) != state["prompt_digest"]:
        raise RequestError(f"input_token_ids: differ from the prompt context_phase_params record ({len(prompt)} "
                           f"tokens here, {state['prompt_len']} there; repeat the context request's prompt)")
    if request.max_tokens != state["max_tokens"]:
        raise RequestError(f"max_tokens: {request.max_tokens!r}, but context_phase_params record "
                           f"{state['max_tokens']} (the total, the first token included)")
    if clamped_new_tokens(limits, len(prompt), request.max_tokens) < 2:   # an engine of another max_seq_len
        raise RequestError(f"max_tokens: {request.max_tokens} with a prompt of {len(prompt)} tokens leaves this "
                           f"engine (max_seq_len {limits.max_seq_len}) no token after the first")
    if isinstance(request.sampling_config, SamplingConfig):
        for name, value in sampling_record(request.sampling_config).items():
            if state["sampling"].get(name) != value:
                raise RequestError(f"sampling_config.{name}: {value!r}, but context_phase_params record "
                                   f"{state['sampling'].get(name)!r}")
    if lora_task_id != state["lora_task_id"]:
        raise RequestError(f"lora_config.task_id: {lora_task_id!r}, but context_phase_params record "
                           f"{state['lora_task_id']!r}")
    if getattr(request.output_config, "return_context_logits", False):
        raise RequestError("output_config.return_context_logits: REQUEST_TYPE_GENERATION_ONLY computes no context")
    return ResumedContext(params.first_gen_tokens[0], float(state["first_log_prob"]),
                          KvSource(state["host"], state["port"], state["handle"], len(prompt)))


class KvTransfer:
    """This Executor's side of the KV transfer: `exports` (the scheduler's), the server (started by
    the first context-only request), and a few fetch threads. Built on the worker thread."""

    def __init__(self, runner, host: str, timeout_s: float):
        self.layout = KvLayout.of(runner)
        self.exports = KvExports(timeout_s)
        self.timeout_s = timeout_s
        self._runner, self._host = runner, host
        self._lock = threading.Lock()
        self._server: KvTransferServer | None = None
        self._fetches: ThreadPoolExecutor | None = None
        self._fetch_sockets = OpenSockets()   # of the fetches under way
        self._closed = self._fetches_cancelled = False
        self.num_fetches = self.num_fetched_bytes = 0   # cumulative, of the fetches that succeeded
        self.fetch_s = 0.0                              # their summed wall time (connect to last byte)

    @property
    def is_single_rank(self) -> bool:
        return self.layout.tensor_parallelism == 1 and self.layout.pipeline_parallelism == 1

    def serve(self) -> tuple[str, int]:
        """The server's (host, port), starting it on the first call. RuntimeError after close or
        when the address cannot be bound."""
        with self._lock:
            if self._closed:
                raise RuntimeError("Executor: shut down; its KV transfer server is closed")
            if self._server is None:
                try:
                    self._server = KvTransferServer(self.exports, self._runner, self.layout, self._host,
                                                    self.timeout_s)
                except OSError as e:
                    raise RuntimeError(f"ExecutorConfig.kv_transfer_address: cannot listen on {self._host!r}: "
                                       f"{e}") from None
            return self._server.address

    def fetch(self, source: KvSource) -> Future:
        """-> a Future of the blocks (kv_transfer.FetchedBlocks); its exception names
        context_phase_params when they cannot be fetched (within timeout_s, connect to last byte)."""
        with self._lock:
            if self._fetches_cancelled:
                future: Future = Future()
                future.cancel()
                return future
            if self._fetches is None:
                self._fetches = ThreadPoolExecutor(_MAX_FETCHES, thread_name_prefix="KvTransferFetch")
            return self._fetches.submit(self._fetch, source)

    def _fetch(self, source: KvSource):
        start = time.perf_counter()
        expect = FetchExpectation(source.num_tokens, self._runner.tokens_per_block, self._runner.kv_block_byte_shapes,
                                  self.layout.kv_cache_dtype)
        try:
            fetched = fetch_blocks(source.host, source.port, source.handle, self.layout, self.timeout_s, expect,
                                   self._fetch_sockets)
        except Exception as e:  # noqa: BLE001 - any failure is the request's error
            raise RuntimeError(f"context_phase_params: the KV blocks could not be fetched: {e}") from None
        with self._lock:
            self.num_fetches += 1
            self.num_fetched_bytes += fetched.values.numel() + (0 if fetched.scales is None else fetched.scales.numel())
            self.fetch_s += time.perf_counter() - start
        return fetched

    def cancel_fetches(self) -> None:
        """Shutdown: end the fetches under way (their requests get an error) and refuse new ones,
        so that no peer holds the worker past shutdown."""
        with self._lock:
            self._fetches_cancelled = True
            fetches = self._fetches
        self._fetch_sockets.abort_all()
        if fetches is not None:
            fetches.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """After the worker stopped: no more transfers; the blocks still reserved are freed."""
        self.cancel_fetches()
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
            fetches, self._fetches = self._fetches, None
        if server is not None:
            server.close()
        try:
            self.exports.release_all()
        except Exception:  # noqa: BLE001 - after a worker crash the pool's bookkeeping may be in doubt
            logger.exception("freeing the KV blocks kept for fetches failed")
        if fetches is not None:
            fetches.shutdown(wait=False, cancel_futures=True)
