"""The native CPU layer: C++ kernels compiled at run time with the system compiler and loaded with
ctypes (cpu_native: few-row linears, norms, activations, paged decode attention; cpu_weight_only:
int8 / int4 GEMVs; act_quant: the int8-activation dot products; blocks: llama.cpp's quantized block
formats; cpu_decode_step: the fused generation step). Callers: the torch backend
(runtime.kernels.torch_kernels)."""
