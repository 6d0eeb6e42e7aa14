"""The engine requests behind one OpenAI request (samples.serve): one streamed engine request per
choice (n per prompt: the engine has no num_return_sequences yet, so choice j draws with seed + j),
their responses merged into one sequence of `ChoiceUpdate`s (text deltas, log probs, finish
reasons) in arrival order. Owns the choices' text streams, token counts and clocks; lives on the
handler's event loop; `close()` cancels whatever is still running (a disconnect, an error)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from batch_manager.executor import QueueFullError
from samples.serve.bridge import SHUTTING_DOWN, ResponseEvent
from samples.serve.detokenizer import TextStream
from samples.serve.metrics import LatencyMetrics, RequestTimer
from samples.serve.openai_protocol import CompletionSpec, ModelInfo, OpenAIError, engine_field_to_openai
from samples.serve.params import name_body_field, parse_generate_body


@dataclass(frozen=True)
class TokenLogProb:
    token: str            # the token decoded alone (U+FFFD where it holds part of a character)
    log_prob: float
    text_offset: int      # characters of the choice's text before the token
    top: tuple[tuple[str, float], ...] = ()   # top_logprobs k: the k most likely tokens (decoded) and log probs


@dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str
    log_probs: tuple[TokenLogProb, ...] = ()
    finish_reason: str | None = None       # "stop" (end id or a stop string) or "length"


@dataclass
class Choice:
    index: int
    prompt_index: int
    max_tokens: int
    stream: TextStream
    timer: RequestTimer | None
    request_id: int | None = None
    events: asyncio.Queue | None = None    # the bridge's queue of ResponseEvent
    num_tokens: int = 0                    # generated tokens consumed (up to a stop string's last)
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    log_probs: list[TokenLogProb] = field(default_factory=list)


class ChoiceRun:
    def __init__(self, bridge, spec: CompletionSpec, info: ModelInfo, metrics: LatencyMetrics | None):
        self.bridge, self.spec, self.info = bridge, spec, info
        self.choices = [Choice(i * spec.n + j, i, spec.max_tokens[i], TextStream(info.tokenizer, spec.stop),
                               metrics.start(len(prompt)) if metrics is not None else None)
                        for i, prompt in enumerate(spec.prompts) for j in range(spec.n)]
        self._merged: asyncio.Queue = asyncio.Queue()    # of (choice index, ResponseEvent)
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
        """Queue every choice's engine request. OpenAIError: 400 (a value the request path
        refuses), 429 (the queue is full), 503 (shutting down); nothing is left running then."""
        loop = asyncio.get_running_loop()
        for choice in self.choices:
            try:
                params = parse_generate_body(self.spec.engine_body(choice.prompt_index, choice.index % self.spec.n))
                choice.request_id, choice.events = self.bridge.submit(params.to_request, self.spec.logprobs, loop)
            except ValueError as e:
                self.close()
                raise self._bad_request(str(e)) from None
            except QueueFullError as e:
                self.close()
                raise OpenAIError(429, str(e), None, "queue_full") from None
            except RuntimeError as e:
                self.close()
                raise OpenAIError(503, str(e), None, "shutting_down") from None
            self._pumps.append(asyncio.create_task(self._pump(choice.index, choice.events)))

    async def next_update(self) -> ChoiceUpdate:
        """The next choice's progress (call while not is_done). OpenAIError for an error response."""
        while True:   # responses already merged when a stop string ended their choice: dropped
            index, event = await self._merged.get()
            choice = self.choices[index]
            if choice.finish_reason is None:
                break
        if event.error:
            raise self._event_error(event)
        delta = choice.stream.add(event.output_ids)
        choice.num_tokens += delta.num_tokens
        if choice.timer is not None:
            choice.timer.on_tokens(delta.num_tokens)
        log_probs = self._token_log_probs(event, delta.token_offsets)
        text = delta.text
        if delta.is_stopped:
            choice.finish_reason = "stop"
            self._stop(choice)
        elif event.is_final:
            tail = choice.stream.finish()
            text += tail.text
            choice.finish_reason = "stop" if tail.is_stopped or choice.num_tokens < choice.max_tokens else "length"
            if choice.timer is not None:
                choice.timer.finish()
        choice.text.append(text)
        choice.log_probs.extend(log_probs)
        return ChoiceUpdate(index, text, log_probs, choice.finish_reason)

    async def run_to_end(self) -> None:
        while not self.is_done:
            await self.next_update()

    def close(self) -> None:
        """Cancel every unfinished choice's engine request and stop the pumps. Idempotent."""
        for choice in self.choices:
            if choice.request_id is not None and choice.finish_reason is None:
                self.bridge.cancel(choice.request_id)
        for pump in self._pumps:
            pump.cancel()

    # -- internals ----------------------------------------------------------------------------

    async def _pump(self, index: int, events: asyncio.Queue) -> None:
        while True:
            event: ResponseEvent = await events.get()
            self._merged.put_nowait((index, event))
            if event.is_final:
                return

    def _stop(self, choice: Choice) -> None:
        """A stop string ended the choice: stop its engine request (its later responses are dropped)."""
        self.bridge.cancel(choice.request_id)
        if choice.timer is not None:
            choice.timer.finish()

    def _token_log_probs(self, event: ResponseEvent, offsets: tuple[int, ...]) -> tuple[TokenLogProb, ...]:
        if not self.spec.logprobs or event.log_probs is None:
            return ()
        decode = self.info.tokenizer.decode
        tops = event.top_log_probs or [((), ())] * len(event.output_ids)
        return tuple(TokenLogProb(decode([token]), log_prob, offset,
                                  tuple((decode([i]), v) for v, i in zip(values, ids)))
                     for token, log_prob, offset, (values, ids) in zip(event.output_ids, event.log_probs, offsets, tops))

    def _bad_request(self, message: str) -> OpenAIError:
        field, message = engine_field_to_openai(message, self.spec.is_chat)
        return OpenAIError(400, message, field)

    def _event_error(self, event: ResponseEvent) -> OpenAIError:
        if event.is_bad_request:
            return self._bad_request(name_body_field(event.error))
        if event.error == SHUTTING_DOWN:
            return OpenAIError(503, event.error, None, "shutting_down")
        return OpenAIError(500, event.error)
