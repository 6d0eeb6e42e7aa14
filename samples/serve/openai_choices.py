"""The engine requests behind one OpenAI request (samples.serve): per prompt, one streamed engine
request with num_return_sequences n for its n choices (sharing the prompt's KV blocks; choice j
is sample j, drawing with seed + j; past the engine's samples per request, several such requests,
`ModelInfo.max_samples_per_request` choices each), or one request per choice where the engine cannot share
(top_logprobs: its top log probs are per single sequence); their events merged into one sequence
of `ChoiceUpdate`s (text deltas, log probs, tool call deltas, finish reasons) in arrival order.
Owns the choices' text streams, token counts and clocks; lives on the handler's event loop, the
text work (detokenizing, log-prob strings, tool call parsing) on a worker thread; `close()`
cancels whatever is still running (a disconnect, an error)."""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field, replace

from batch_manager import GuidedDecodingParams, GuideType
from batch_manager.executor import QueueFullError
from samples.serve.bridge import SHUTTING_DOWN, ResponseEvent
from samples.serve.detokenizer import TextDelta, TextStream
from samples.serve.metrics import LatencyMetrics, RequestTimer
from samples.serve.openai_basics import ModelInfo, OpenAIError
from samples.serve.openai_protocol import CompletionSpec, engine_field_to_openai
from samples.serve.params import name_body_field, parse_generate_body
from samples.serve.tool_call_parser import ToolCallDelta, ToolCallParser


@dataclass(frozen=True)
class TokenLogProb:
    token: str            # the characters the token completes ("" for one ending inside a character)
    log_prob: float
    text_offset: int      # characters of the choice's text before the token
    token_bytes: bytes = b""   # the token's own bytes (OpenAI's `bytes`)
    # top_logprobs k: the k most likely tokens: (text alone, or "bytes:\\xNN.." where that splits
    # a character; log prob; bytes)
    top: tuple[tuple[str, float, bytes], ...] = ()


@dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str
    log_probs: tuple[TokenLogProb, ...] = ()
    finish_reason: str | None = None       # "stop" (end id or a stop string), "length" or "tool_calls"
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass
class Choice:
    index: int
    prompt_index: int
    max_tokens: int
    stream: TextStream
    timer: RequestTimer | None
    tools: ToolCallParser | None = None    # with tools: splits the reply into content and calls
    echo: str = ""                         # text to send before the first delta (completions' echo)
    num_tokens: int = 0                    # generated tokens consumed (up to a stop string's last)
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)   # content
    log_probs: list[TokenLogProb] = field(default_factory=list)


@dataclass
class EngineRequest:
    choice_indices: tuple[int, ...]        # sample i of the request -> the choice it feeds
    request_id: int | None = None
    events: asyncio.Queue | None = None    # the bridge's queue of ResponseEvent


@dataclass(frozen=True)
class _Advance:
    """One event's effect on a choice, made on the text thread."""
    delta: TextDelta
    text: str
    log_probs: tuple[TokenLogProb, ...]
    tool_calls: tuple[ToolCallDelta, ...]
    is_stopped: bool
    # the choice's last log prob entry again, with the flushed end of the text (already streamed: the
    # whole response only)
    last_log_prob: TokenLogProb | None = None


class ChoiceRun:
    def __init__(self, bridge, spec: CompletionSpec, info: ModelInfo, metrics: LatencyMetrics | None,
                 lora=None):
        """lora: the loaded LoRA adapter (lora_routes.LoadedAdapter) every choice runs with, or None."""
        self.lora = lora
        self.bridge, self.spec, self.info = bridge, spec, info
        calls = spec.tools is not None and spec.tools.parses_calls
        self.choices = [Choice(i * spec.n + j, i, spec.max_tokens[i], TextStream(info.tokenizer, spec.stop),
                               metrics.start(len(prompt)) if metrics is not None else None,
                               ToolCallParser(spec.tools.is_forced) if calls else None,
                               spec.echo_texts[i] if spec.echo_texts else "")
                        for i, prompt in enumerate(spec.prompts) for j in range(spec.n)]
        # NOTE: the engine's top log probs are per single sequence: with top_logprobs, n requests;
        # otherwise groups of at most the engine's samples per request (choices j.. draw from seed + j..)
        group = 1 if spec.top_logprobs else info.max_samples_per_request
        self.engine_requests = [EngineRequest(tuple(range(i * spec.n + j, i * spec.n + min(j + group, spec.n))))
                                for i in range(len(spec.prompts)) for j in range(0, spec.n, group)]
        self._engine_of = {c: e for e, r in enumerate(self.engine_requests) for c in r.choice_indices}
        self._merged: asyncio.Queue = asyncio.Queue()    # of (engine request index, ResponseEvent)
        self._pumps: list[asyncio.Task] = []

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.spec.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def is_done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def submit(self) -> None:
        """Queue every engine request. OpenAIError: 400 (a value the request path refuses), 429
        (a refusal for load: the queue, its tokens, the time-to-first-token budget; with
        Retry-After), 503 (shutting down); nothing is left running then."""
        loop = asyncio.get_running_loop()
        guide = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, self.spec.grammar) if self.spec.grammar else None
        for index, engine in enumerate(self.engine_requests):
            first = self.choices[engine.choice_indices[0]]
            try:
                body = self.spec.engine_body(first.prompt_index, first.index % self.spec.n)
                n = len(engine.choice_indices)
                params = replace(parse_generate_body(body), num_return_sequences=n, guided_decoding_params=guide,
                                 lora=self.lora)
                engine.request_id, engine.events = self.bridge.submit(functools.partial(self.bridge.build, params),
                                                                      self.spec.logprobs, loop, n)
            except ValueError as e:
                self.close()
                raise self._bad_request(str(e)) from None
            except QueueFullError as e:
                self.close()
                raise OpenAIError(429, str(e), None, "queue_full", retry_after_s=e.retry_after_s) from None
            except RuntimeError as e:
                self.close()
                raise OpenAIError(503, str(e), None, "shutting_down") from None
            self._pumps.append(asyncio.create_task(self._pump(index, engine)))

    async def next_update(self) -> ChoiceUpdate:
        """The next choice's progress (call while not is_done). OpenAIError for an error response."""
        while True:   # responses already merged when a stop string ended their choice: dropped
            index, event = await self._merged.get()
            engine = self.engine_requests[index]
            if event.error and any(self.choices[c].finish_reason is None for c in engine.choice_indices):
                raise self._event_error(event)
            choice = self.choices[engine.choice_indices[event.sequence_index]]
            if choice.finish_reason is None and not event.error:
                break
        # NOTE: detokenizing and parsing run off the event loop (they hold the GIL for a while on
        # long outputs); each choice's events are applied in order, one at a time.
        advance = await asyncio.get_running_loop().run_in_executor(None, self._advance, choice, event)
        choice.num_tokens += advance.delta.num_tokens
        if choice.timer is not None:
            choice.timer.on_tokens(advance.delta.num_tokens)
        if advance.is_stopped:
            choice.finish_reason = "stop"
            self._stop(choice)
        elif event.is_final:
            choice.finish_reason = "stop" if advance.delta.is_stopped or choice.num_tokens < choice.max_tokens \
                else "length"
            if choice.timer is not None:
                choice.timer.finish()
        if choice.finish_reason == "stop" and choice.tools is not None and choice.tools.calls:
            choice.finish_reason = "tool_calls"
        choice.text.append(advance.text)
        if advance.last_log_prob is not None and self.spec.logprobs:
            choice.log_probs[-1] = advance.last_log_prob
        choice.log_probs.extend(advance.log_probs)
        return ChoiceUpdate(choice.index, advance.text, advance.log_probs, choice.finish_reason, advance.tool_calls)

    async def run_to_end(self) -> None:
        while not self.is_done:
            await self.next_update()

    def close(self) -> None:
        """Cancel every engine request with an unfinished choice and stop the pumps. Idempotent."""
        for engine in self.engine_requests:
            if engine.request_id is not None and any(self.choices[c].finish_reason is None
                                                     for c in engine.choice_indices):
                self.bridge.cancel(engine.request_id)
        for pump in self._pumps:
            pump.cancel()

    # -- internals ----------------------------------------------------------------------------

    async def _pump(self, index: int, engine: EngineRequest) -> None:
        num_open = len(engine.choice_indices)
        while num_open:
            event: ResponseEvent = await engine.events.get()
            self._merged.put_nowait((index, event))
            num_open = 0 if event.error else num_open - event.is_final

    def _advance(self, choice: Choice, event: ResponseEvent) -> _Advance:
        """On the text thread: the event's tokens through the choice's text stream (and stop
        strings), its log probs, its tool calls."""
        delta = choice.stream.add(event.output_ids)
        text, is_stopped = delta.text, delta.is_stopped
        last = None
        if event.is_final and not is_stopped:
            tail = choice.stream.finish()
            text += tail.text
            texts = delta.token_texts
            if tail.flushed and texts:   # the output ends inside a character: its last token holds the U+FFFD
                texts = texts[:-1] + (texts[-1] + tail.flushed,)
            elif tail.flushed and choice.log_probs:   # a final event without tokens: the previous event's last
                last = replace(choice.log_probs[-1], token=choice.log_probs[-1].token + tail.flushed)
            delta = TextDelta(delta.text, delta.num_tokens, tail.is_stopped, delta.token_offsets, texts)
        log_probs = self._token_log_probs(event, delta)
        calls: list[ToolCallDelta] = []
        if choice.tools is not None:
            text, calls = choice.tools.feed(text)
            if event.is_final or is_stopped:
                rest, more = choice.tools.finish()
                text, calls = text + rest, calls + more
        if choice.echo:
            text, choice.echo = choice.echo + text, ""
        return _Advance(delta, text, log_probs, tuple(calls), is_stopped, last)

    def _stop(self, choice: Choice) -> None:
        """A stop string ended the choice: once every choice of its engine request has ended, stop
        the request (its later responses are dropped)."""
        engine = self.engine_requests[self._engine_of[choice.index]]
        if all(self.choices[c].finish_reason is not None for c in engine.choice_indices):
            self.bridge.cancel(engine.request_id)
        if choice.timer is not None:
            choice.timer.finish()

    def _token_log_probs(self, event: ResponseEvent, delta: TextDelta) -> tuple[TokenLogProb, ...]:
        if not self.spec.logprobs or event.log_probs is None:
            return ()
        token_bytes = self.info.token_bytes
        tops = event.top_log_probs or [((), ())] * len(event.output_ids)
        # an alternative's text is its own (OpenAI's bytes: form where that splits a character);
        # the sampled token's, among them, is the same as its `token`
        return tuple(TokenLogProb(text, log_prob, offset, token_bytes(token),
                                  tuple((text if i == token else token_bytes.text(i), v, token_bytes(i))
                                        for v, i in zip(values, ids)))
                     for token, log_prob, offset, text, (values, ids)
                     in zip(event.output_ids, event.log_probs, delta.token_offsets, delta.token_texts, tops))

    def _bad_request(self, message: str) -> OpenAIError:
        field, message = engine_field_to_openai(message, self.spec.is_chat)
        return OpenAIError(400, message, field)

    def _event_error(self, event: ResponseEvent) -> OpenAIError:
        if event.is_bad_request:
            return self._bad_request(name_body_field(event.error))
        if event.error == SHUTTING_DOWN:
            return OpenAIError(503, event.error, None, "shutting_down")
        return OpenAIError(500, event.error)
