"""One stream, ours against llama.cpp on the same weights at the same precision, in one run.

The weights (--model): `smollm2`, the real default model's GGUF (SmolLM2-135M-Instruct, Q4_1),
de-quantized and written again in each format (--formats: F32, Q8_0, Q4_0, Q4_1, Q5_0, Q6_K, or the
per-tensor Q4_K_M recipe of samples.microbench.gguf_recipes, with llama.cpp's fallbacks for rows
that are not a multiple of 256); or `llama-1b`, a random-weight ~1.1B LLaMA
(samples.microbench.random_llama: hidden 2048, 16 layers, intermediate 8192) written in each format
from the same draws, where memory bandwidth rather than the fixed cost per token decides (fed token
ids: its vocabulary is synthetic). llama.cpp (the `xllamacpp` wheel, its server embedded in this
process; `pip install --no-deps xllamacpp`) generates from each file; ours generates from engines
built from the F32 file in float32 and in the matching weight-only modes (int8 for Q8_0, int4 group
32 for Q4_0), each exact and with int8 activations (act_quant), and from the format's own file with
its blocks kept as they are ("blocks"). Each side: greedy, one request, the same prompt, N new
tokens, the generation rate (tokens after the first / their time), best of --repeats; ours once per
--decode-steps value (DecodingConfig.max_decode_steps: several greedy steps per worker iteration). Every
measurement runs in a fresh process: llama.cpp's threads and a thread pool left by an engine build
would otherwise share the cores with the side being timed (runtime.engine.build_engine's NOTE).

    python -m samples.microbench.llama_cpp_compare [--model smollm2|llama-1b] [--new-tokens 64] [--repeats 3]
        [--threads 2] [--formats F32 Q8_0 Q4_0 Q4_1 Q5_0 Q6_K Q4_K_M] [--our-modes blocks ...] [--decode-steps 1 8]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from samples.microbench.weight_only import cpu_description

PROMPT = "Here is part of Python's documentation. Explain what a generator is, in a few sentences."
LLAMA_CPP_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q6_K", "Q4_K_M")
# ours per llama.cpp format: the exact weight-only mode, then the int8-activation one (llama.cpp's own
# arithmetic for these formats: activations quantized to 8 bits per block of 32)
OUR_MODES = {"F32": {"float32": {}},
             "Q8_0": {"int8": {"weight_only": "int8"}, "int8+a8": {"weight_only": "int8", "act_quant": "int8"}},
             "Q4_0": {"int4 g32": {"weight_only": "int4", "group_size": 32},
                      "int4 g32+a8": {"weight_only": "int4", "group_size": 32, "act_quant": "int8"}}}


def our_modes(type_name: str) -> dict[str, tuple[str, dict]]:
    """Our engines compared with llama.cpp's `type_name` file: mode -> (the file built from: "F32" or
    the format's own, build_engine's fields). A quantized file also runs its blocks as they are."""
    modes = {mode: ("F32", fields) for mode, fields in OUR_MODES.get(type_name, {}).items()}
    if type_name != "F32":
        modes["blocks"] = (type_name, {"weight_format": "keep"})
    return modes


def rewrite_gguf(source: str, destination: str, type_name: str) -> str:
    """`source` with every 2-D weight de-quantized and stored as `type_name` (a GGML type, or a
    recipe of samples.microbench.gguf_recipes choosing one per tensor: Q4_K_M); 1-D tensors stay F32."""
    import gguf

    from runtime.quantization.k_quants import quantize
    from samples.microbench.gguf_recipes import file_type_name, tensor_type
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(destination, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type)
    writer.add_file_type(int(gguf.LlamaFileType[file_type_name(type_name)]))
    has_output = any(tensor.name == "output.weight" for tensor in reader.tensors)
    num_layers = 1 + max((int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")), default=0)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        stored = "F32" if values.ndim != 2 or type_name == "F32" else \
            tensor_type(tensor.name, values.shape[-1], type_name, num_layers, has_output)
        if stored == "F32":
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, quantize(values, stored), raw_dtype=gguf.GGMLQuantizationType[stored])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


def in_fresh_process(fn, *args):
    """fn(*args) in a new spawned process (fn and its arguments picklable): its result."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def llama_cpp_server(path: str, threads: int, parallel: int, context_per_slot: int):
    import xllamacpp
    params = xllamacpp.CommonParams()
    params.model.path = path
    params.n_parallel = parallel
    params.n_ctx = parallel * context_per_slot
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    return xllamacpp.Server(params)


def llama_cpp_completion(server, prompt: str | list[int], new_tokens: int) -> dict:
    body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
    result = server.handle_completions(body)
    if not isinstance(result, dict) or "timings" not in result:
        raise RuntimeError(f"llama.cpp: {result!r:.500}")
    return result


def llama_cpp_rate(path: str, prompt: str | list[int], new_tokens: int, threads: int) -> float:
    """llama.cpp's generation tokens/s for one greedy request (its own timings); `prompt` as text or
    token ids."""
    server = llama_cpp_server(path, threads, 1, 1024)
    return float(llama_cpp_completion(server, prompt, new_tokens)["timings"]["predicted_per_second"])


def our_rate(engine_dir: str, prompt_ids: list[int], new_tokens: int, threads: int | None = None,
             max_decode_steps: int = 1) -> float:
    """Our generation tokens/s for one greedy streamed request through the Executor: tokens after
    the first over the time from the first to the last. max_decode_steps > 1: multi-step decoding
    (DecodingConfig.max_decode_steps; the tokens then arrive several per response)."""
    if threads is not None:
        torch.set_num_threads(threads)
    from batch_manager.executor import DecodingConfig, Executor, ExecutorConfig, ModelType, OutputConfig, Request
    config = ExecutorConfig(decoding_config=DecodingConfig(max_decode_steps=max_decode_steps))
    with Executor(engine_dir, ModelType.DECODER_ONLY, config) as executor:
        request_id = executor.enqueue_request(Request(prompt_ids, new_tokens, streaming=True,
                                                      output_config=OutputConfig(exclude_input_from_output=True)))
        stamps, done = [], False
        while not done:
            for response in executor.await_responses(request_id, timeout=600.0):
                if response.has_error():
                    raise RuntimeError(response.error_msg)
                stamps += [time.perf_counter()] * len(response.result.output_token_ids[0])
                done = response.result.is_final
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


RANDOM_PROMPT_IDS = list(range(300, 332))   # the random model's prompt: 32 token ids


def model_files(model: str, work: str, type_names: list[str]) -> tuple[dict[str, str], str | list[int]]:
    """({format: GGUF path}, the prompt llama.cpp is given) of `model` in each format; files already
    in `work` are reused."""
    files = {t: os.path.join(work, f"{model}-{t}.gguf") for t in dict.fromkeys(type_names)}
    missing = {t: path for t, path in files.items() if not os.path.exists(path)}
    if model == "llama-1b":
        from samples.microbench.random_llama import write_random_llama
        for type_name, path in missing.items():
            write_random_llama(path + ".tmp", type_name)
            os.replace(path + ".tmp", path)
        return files, RANDOM_PROMPT_IDS
    from samples.default_model import real_model_gguf
    for type_name, path in missing.items():
        os.replace(rewrite_gguf(real_model_gguf(), path + ".tmp", type_name), path)
    return files, PROMPT


def tokenize(gguf_path: str, text: str, work: str) -> list[int]:
    """`text` as token ids of the GGUF file's own tokenizer."""
    from runtime.loading.gguf_tokenizer import save_gguf_tokenizer
    from samples.real_text import load_tokenizer
    tokenizer_dir = os.path.join(work, "tokenizer")
    save_gguf_tokenizer(gguf_path, tokenizer_dir)
    return load_tokenizer(tokenizer_dir)(text)["input_ids"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--model", choices=("smollm2", "llama-1b"), default="smollm2")
    p.add_argument("--formats", nargs="+", choices=LLAMA_CPP_TYPES, default=list(LLAMA_CPP_TYPES))
    p.add_argument("--work-dir", help="keep the files and engines here (default: a temporary directory)")
    p.add_argument("--our-modes", nargs="+", help="only these of our modes (e.g. blocks float32 int8+a8; default: all)")
    p.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                   help="ours with each DecodingConfig.max_decode_steps (1: one step per iteration, the default)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    known = {mode for type_name in args.formats for mode in our_modes(type_name)}
    if args.our_modes and not set(args.our_modes) <= known:
        p.error(f"--our-modes: {sorted(set(args.our_modes) - known)} are none of the formats' modes {sorted(known)}")
    torch.set_num_threads(args.threads)
    from runtime import ConfigError, build_engine
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work_dir or scratch
        os.makedirs(work, exist_ok=True)
        files, prompt = model_files(args.model, work, ["F32", *args.formats])
        prompt_ids = prompt if isinstance(prompt, list) else tokenize(files["F32"], prompt, work)
        for type_name in args.formats:
            row = {"llama_cpp_tok_s": max(in_fresh_process(llama_cpp_rate, files[type_name], prompt, args.new_tokens,
                                                           args.threads) for _ in range(args.repeats)), "ours": {}}
            for number, (mode, (source, fields)) in enumerate(our_modes(type_name).items()):
                if args.our_modes and mode not in args.our_modes:
                    continue
                engine_dir = os.path.join(work, f"ours-{args.model}-{type_name}-{number}")
                for steps in args.decode_steps:
                    label = mode if steps == 1 else f"{mode}, {steps} steps/call"
                    try:
                        if not os.path.exists(os.path.join(engine_dir, "engine.json")):
                            build_engine(files[source], engine_dir, **fields)
                        row["ours"][label] = max(in_fresh_process(our_rate, engine_dir, prompt_ids, args.new_tokens,
                                                                  args.threads, steps) for _ in range(args.repeats))
                    except ConfigError as e:
                        row["ours"][label] = f"refused: {e}"
            results[type_name] = row
    fp32 = results.get("F32", {}).get("ours", {}).get("float32")
    print(f"{cpu_description()}; {args.model}, one stream, {args.new_tokens} new tokens, {args.threads} threads, best of {args.repeats}:")
    for type_name, row in results.items():
        print(f"  {type_name:5s} llama.cpp {row['llama_cpp_tok_s']:.1f} tok/s")
        for mode, rate in row["ours"].items():
            if isinstance(rate, str):
                print(f"        ours {mode}: {rate}")
                continue
            versus_fp32 = f", {rate / fp32:.2f}x our float32" if isinstance(fp32, float) else ""
            print(f"        ours {mode} {rate:.1f} tok/s ({rate / row['llama_cpp_tok_s']:.2f}x llama.cpp{versus_fp32})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
