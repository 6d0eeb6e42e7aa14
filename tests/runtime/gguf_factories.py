"""Tiny GGUF files written as llama.cpp's converter writes them: a transformers model's parameters
renamed by the gguf package's own name map, laid out as llama.cpp stores them (LLaMA's Q/K rows
permuted, GPT-2's Conv1D weights transposed, fused QKV reordered to [q, k, v]), with the metadata
keys llama.cpp writes and a small byte-level BPE vocabulary; each matmul weight in a chosen tensor
type. Also raw single-tensor files for the de-quantization tests, and ReferenceBlockOps (the native
block kernels' API in float32) for tests of the kept-block paths."""
from __future__ import annotations

import os

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
# our case name -> (llama.cpp architecture, transformers model_type it was made from)
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
             "gpt2": gguf.MODEL_ARCH.GPT2,
             "gpt_neox": gguf.MODEL_ARCH.GPTNEOX, "falcon": gguf.MODEL_ARCH.FALCON, "phi": gguf.MODEL_ARCH.PHI2,
             "phi3": gguf.MODEL_ARCH.PHI3, "bloom": gguf.MODEL_ARCH.BLOOM, "gptj": gguf.MODEL_ARCH.GPTJ}
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


# -- llama.cpp's layouts -------------------------------------------------------------------------

def llama3_rope_freqs(config) -> np.ndarray:
    """float32 [head_dim / 2]: LLaMA 3's rope scaling as llama.cpp's converter writes it (the
    `rope_freqs` tensor, one divisor of each pair's frequency)."""
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    head_dim = config.hidden_size // config.num_attention_heads
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def llama_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: halves-rotary rows -> adjacent-pair rows, per head."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def per_head_to_qkv(w: np.ndarray, num_heads: int) -> np.ndarray:
    """GPT-NeoX / BLOOM fused QKV [heads, 3, head_dim, ...] -> [q, k, v] (llama.cpp's converters)."""
    per_head = w.reshape(num_heads, 3, w.shape[0] // num_heads // 3, *w.shape[1:])
    return np.concatenate([per_head[:, i].reshape(-1, *w.shape[1:]) for i in range(3)])


def falcon_to_qkv(w: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """Falcon's fused QKV, per KV group [its query heads, k, v] -> [q, k, v] (llama.cpp's converter)."""
    head_dim = w.shape[0] // (num_heads + 2 * num_kv_heads)
    grouped = w.reshape(num_kv_heads, num_heads // num_kv_heads + 2, head_dim, *w.shape[1:])
    q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
    return np.concatenate([x.reshape(-1, *w.shape[1:]) for x in (q, k, v)])


def _relayout(case: str, name: str, w: np.ndarray, config) -> np.ndarray:
    if case == "llama" and ("q_proj" in name or "k_proj" in name):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        return llama_permute(w, heads)
    if case == "gpt2" and w.ndim == 2 and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return np.ascontiguousarray(w.T)
    if case in ("gpt_neox", "bloom") and "query_key_value" in name:
        return per_head_to_qkv(w, config.num_attention_heads)
    if case == "falcon" and "query_key_value" in name:
        kv = (config.num_kv_heads if config.new_decoder_architecture else (1 if config.multi_query else None))
        return falcon_to_qkv(w, config.num_attention_heads, kv or config.num_attention_heads)
    return w


# -- metadata --------------------------------------------------------------------------------------

def _get(config, *names, default=None):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def _metadata(writer: gguf.GGUFWriter, case: str, config) -> None:
    hidden = _get(config, "hidden_size", "n_embd")
    heads = _get(config, "num_attention_heads", "n_head")
    head_dim = hidden // heads
    writer.add_block_count(_get(config, "num_hidden_layers", "n_layer"))
    writer.add_context_length(_get(config, "max_position_embeddings", "n_positions", default=2048))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(_get(config, "intermediate_size", "n_inner", "ffn_hidden_size",
                                        default=4 * hidden))
    writer.add_head_count(heads)
    kv = {"falcon": _get(config, "num_kv_heads") if getattr(config, "new_decoder_architecture", False) else 1,
          "llama": config.num_key_value_heads if case == "llama" else None}.get(case)
    kv = kv or _get(config, "num_key_value_heads", default=heads)
    writer.add_head_count_kv(kv)
    if case in ("llama", "qwen2", "qwen3", "phi3"):
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    else:
        writer.add_layer_norm_eps(_get(config, "layer_norm_eps", "layer_norm_epsilon"))
    if case == "qwen3":   # llama.cpp's converter writes a config's explicit head_dim (Qwen3's is free)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        writer.add_rope_freq_base(rope["rope_theta"])
    fraction = rope.get("partial_rotary_factor", _get(config, "partial_rotary_factor", "rotary_pct", default=1.0))
    rotary_dim = _get(config, "rotary_dim", default=int(fraction * head_dim))
    if case in ("llama", "gpt_neox", "phi", "phi3", "gptj"):
        writer.add_rope_dimension_count(rotary_dim)
    if case == "llama":
        writer.add_vocab_size(config.vocab_size)
    if case == "gpt_neox":
        writer.add_parallel_residual(config.use_parallel_residual)
    if case == "phi3" and config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)


def tiny_vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of exactly `size` tokens: 3 control tokens, the printable ASCII
    bytes and newline in GPT-2's byte alphabet, then merges of letter pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    spelled = bytes_to_unicode()
    tokens = ["<unk>", "<s>", "</s>"] + [spelled[b] for b in [10, *range(32, 127)]]
    letters = "etaoinshrdlu"
    merges = [f"{a} {b}" for a in letters for b in letters][:size - len(tokens)]
    tokens += [m.replace(" ", "") for m in merges]
    assert len(tokens) == size and len(set(tokens)) == size, (len(tokens), size)
    return tokens, [3, 3, 3] + [1] * (size - 3), merges


def _tokenizer(writer: gguf.GGUFWriter, vocab_size: int, ids: dict[str, int | None]) -> None:
    tokens, types, merges = tiny_vocabulary(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, token_id in ids.items():
        if token_id is not None:
            getattr(writer, f"add_{name}")(token_id)
    writer.add_chat_template(CHAT_TEMPLATE)


# -- tensors ---------------------------------------------------------------------------------------

def encode(w: np.ndarray, kind: Q) -> tuple[np.ndarray, Q | None]:
    """(array for GGUFWriter.add_tensor, its raw_dtype) of float32 `w` stored as `kind`."""
    if kind == Q.F32:
        return w.astype(np.float32), None
    if kind == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), kind), kind


def write_gguf(path: str | os.PathLike, case: str, model, matmul_type=Q.F32, name: str | None = None,
               extra: dict | None = None, extra_keys: dict[str, int] | None = None) -> str:
    """Write `model` (a transformers model of `case`'s family) as llama.cpp would; every 2-D weight in
    `matmul_type` (norms and biases F32), or as `matmul_type(gguf name, float32 array)` gives it
    (data, raw dtype). `extra`: GGUF name -> float32 array to add; `extra_keys`: metadata (int: uint32,
    float: float32, str: string)."""
    arch, config = GGUF_ARCH[case], model.config
    params = {n: p.detach().float().numpy() for n, p in model.named_parameters()}
    num_layers = _get(config, "num_hidden_layers", "n_layer")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    writer = gguf.GGUFWriter(os.fspath(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name or case)
    _metadata(writer, case, config)
    for key, value in (extra_keys or {}).items():
        add = {float: writer.add_float32, str: writer.add_string}.get(type(value), writer.add_uint32)
        add(key, value)
    _tokenizer(writer, config.vocab_size, {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                                           "pad_token_id": getattr(config, "pad_token_id", None)})
    for hf_name, w in params.items():
        gguf_name = name_map.get_name(hf_name.removeprefix("transformer.") if case == "bloom" else hf_name,
                                      try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        w = _relayout(case, hf_name, w, config)
        kind = matmul_type if w.ndim == 2 else Q.F32
        data, raw_dtype = kind(gguf_name, w) if callable(kind) else encode(w, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    for gguf_name, w in (extra or {}).items():
        writer.add_tensor(gguf_name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def random_blocks(kind: Q, num_rows: int, row_elements: int, seed: int = 0) -> np.ndarray:
    """Random stored bytes of a [num_rows, row_elements] tensor of `kind` (uint8 [rows, row bytes])."""
    block_size, type_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num_rows, row_elements // block_size * type_bytes), dtype=np.uint8)


def k_quant_blocks(kind: Q, num_rows: int, row_elements: int, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks whose f16 scales are small and finite (gguf cannot quantize K types)."""
    blocks = random_blocks(kind, num_rows, row_elements, seed)
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    view = blocks.reshape(num_rows, -1, block_bytes)
    scales = np.random.default_rng(seed + 1).uniform(0.001, 0.01, view.shape[:2] + (2,)).astype(np.float16)
    # where ggml keeps the f16 d (and dmin) of each 256-element block
    at = {Q.Q2_K: block_bytes - 4, Q.Q3_K: block_bytes - 2, Q.Q4_K: 0, Q.Q5_K: 0, Q.Q6_K: block_bytes - 2}[kind]
    width = 2 if kind in (Q.Q2_K, Q.Q4_K, Q.Q5_K) else 1
    view[:, :, at:at + 2 * width] = scales[:, :, :width].view(np.uint8).reshape(num_rows, -1, 2 * width)
    return blocks


def write_tensors(path: str | os.PathLike, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama") -> str:
    """A GGUF with only these tensors and no model keys: name -> (stored bytes, their type), or
    (a numpy array, None) stored in its own dtype's type."""
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def state_dict_copy(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors, each its own copy (tied ones too), for save_file."""
    return {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}


class ReferenceBlockOps:
    """The native block kernels' API (runtime.kernels.cpu.blocks.BlockOps) in torch, recording each
    call's (op, format, rows): with `quantized_inputs`, their arithmetic (inputs quantized to 8 bits,
    torch_kernels/block_reference.py), else float32 products of the de-quantized blocks; a stand-in
    where a test needs the native dispatch without the library, or its reference."""

    def __init__(self, quantized_inputs: bool = False):
        self.calls = []
        self.quantized_inputs = quantized_inputs

    def linear(self, x, blocks, fmt, k, bias=None, out=None, accumulate=False, isa=None):
        from runtime.quantization.gguf_blocks import BLOCK_FORMATS
        assert x.dtype == torch.float32 and x.stride(1) == 1 and blocks.dtype == torch.uint8
        assert out is None or out.stride(1) == 1
        assert BLOCK_FORMATS[fmt].columns(blocks.shape[1]) == k == x.shape[1]
        self.calls.append(("linear", fmt, x.shape[0]))
        if self.quantized_inputs:
            from runtime.kernels.torch_kernels.block_reference import block_linear_reference
            y = block_linear_reference(x, blocks, fmt, k, bias)
        else:
            y = torch.nn.functional.linear(x, BLOCK_FORMATS[fmt].dequantize(blocks), bias)
        if out is None:
            return y
        return out.add_(y) if accumulate else out.copy_(y)

    def bind(self, blocks, fmt, k, bias=None, isa=None):
        return ReferenceBoundLinear(self, blocks, fmt, k, bias)

    def dequantize(self, blocks, fmt, k, start, stop, out=None):
        from runtime.quantization.gguf_blocks import BLOCK_FORMATS
        self.calls.append(("dequantize", fmt, stop - start))
        return BLOCK_FORMATS[fmt].dequantize(blocks[start:stop])


class ReferenceBoundLinear:
    """BlockOps.bind's result (cpu/blocks.BoundLinear) over ReferenceBlockOps: the blocks held as
    given (ggml's layout), called as a linear, de-quantized by row range."""

    def __init__(self, ops: ReferenceBlockOps, blocks, fmt, k, bias):
        self.ops, self.blocks, self.fmt, self.k, self.bias = ops, blocks, fmt, k, bias

    def __call__(self, x, out=None, accumulate=False):
        return self.ops.linear(x, self.blocks, self.fmt, self.k, self.bias, out, accumulate)

    def dequantize(self, start, stop, out=None):
        return self.ops.dequantize(self.blocks, self.fmt, self.k, start, stop, out)

    def rows(self, ids):
        picked = self.blocks[ids].contiguous()
        return self.ops.dequantize(picked, self.fmt, self.k, 0, picked.shape[0])
