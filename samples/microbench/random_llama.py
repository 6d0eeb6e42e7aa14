"""A random-weight LLaMA written as a GGUF file the way llama.cpp's converter lays one out, for the
speed benchmarks at a size where memory bandwidth, not the fixed cost per step, decides.

The default shape is the ~1.1B model of the native-layer benchmarks: hidden 2048, 16 layers, 32 query
/ 8 KV heads, intermediate 8192, vocabulary 32000, untied output. Every weight is drawn from a
generator seeded by (seed, tensor name), so the F32, Q8_0 and Q4_0 files of one seed hold the same
model up to their quantization. The vocabulary is a synthetic byte-level BPE (256 byte tokens, then
merges of byte pairs) that llama.cpp and transformers' GGUF converter both accept: the benchmarks feed
token ids, never text. Tensors are written one at a time (the F32 file is 4.4 GB; it is never held in
memory whole).

    python -m samples.microbench.random_llama OUT.gguf [--type F32|Q8_0|Q4_0] [--layers 16]
"""
from __future__ import annotations

import argparse
import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 8192
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape [rows, columns]) of every tensor, in llama.cpp's order."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab_size, h))]
        for i in range(self.num_layers):
            out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                    (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                    (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.ffn_gate.weight", (self.intermediate_size, h)),
                    (f"blk.{i}.ffn_up.weight", (self.intermediate_size, h)),
                    (f"blk.{i}.ffn_down.weight", (h, self.intermediate_size))]
        return out + [("output_norm.weight", (h,)), ("output.weight", (self.vocab_size, h))]

    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values of one tensor: norms near 1, matmul weights N(0, 0.02), scaled down with depth
    so the residual stream stays of order one through the layers."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(shape) == 1:
        return (1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def byte_pair_vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 bytes in GPT-2's alphabet, then
    tokens made by merging two byte tokens, until `size` tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = list(bytes_to_unicode().values())
    tokens = ["<unk>", "<s>", "</s>"] + alphabet
    num_merges = size - len(tokens)
    if num_merges < 0 or num_merges > len(alphabet) ** 2:
        raise ValueError(f"vocab_size: {size} must be between {len(tokens)} and {len(tokens) + len(alphabet) ** 2}")
    merges = [f"{a} {b}" for a in alphabet for b in alphabet][:num_merges]
    tokens += [m.replace(" ", "") for m in merges]
    return tokens, [3, 3, 3] + [1] * (size - 3), merges


def write_random_llama(path: str, type_name: str = "F32", shape: LlamaShape = LlamaShape(), seed: int = 0) -> str:
    """Write the model as one GGUF file with every 2-D weight stored as `type_name` (F32, F16, a
    block format runtime.quantization.k_quants writes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K; or a per-tensor recipe of samples.microbench.gguf_recipes: Q4_K_M); 1-D tensors stay F32."""
    import gguf

    from runtime.quantization.k_quants import quantize
    from samples.microbench.gguf_recipes import file_type_name, tensor_type
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random-llama-{shape.num_parameters() / 1e9:.1f}B")
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_file_type(int(gguf.LlamaFileType[file_type_name(type_name)]))
    tokens, types, merges = byte_pair_vocabulary(shape.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def stored_type(name: str, dims: tuple[int, ...]) -> str:
        """F32 for 1-D tensors, else the recipe's type (dims: numpy order, columns last)."""
        if len(dims) == 1 or type_name == "F32":
            return "F32"
        return tensor_type(name, dims[-1], type_name, shape.num_layers, has_output=True)

    # The header lists every tensor's type and byte size before any data: one pass computes them
    # from the shapes (no values), the second writes each tensor as it is drawn.
    for name, dims in shape.tensors():
        stored = stored_type(name, dims)
        if stored == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        elif stored == "F16":
            writer.add_tensor_info(name, dims, np.dtype(np.float16), 2 * int(np.prod(dims)))
        else:
            qtype = gguf.GGMLQuantizationType[stored]
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = gguf.quant_shape_to_byte_shape(dims, qtype)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(dims)) // block * type_bytes,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in shape.tensors():
        values, stored = random_tensor(name, dims, seed), stored_type(name, dims)
        writer.write_tensor_data(values if stored == "F32" else
                                 values.astype(np.float16) if stored == "F16" else quantize(values, stored))
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--type", default="F32")
    p.add_argument("--layers", type=int, default=LlamaShape.num_layers)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = LlamaShape(num_layers=args.layers)
    write_random_llama(args.path, args.type, shape, args.seed)
    print(f"{args.path}: {shape.num_parameters() / 1e9:.2f}B parameters, {args.type}")


if __name__ == "__main__":
    main()
