"""The CUDA path: the cuda_src/ programs as text (sources), compiled by CuPy / NVRTC (nvrtc) and
launched with their contracts checked (launchers, decoding_launchers) by the `cuda` backend
(cuda_backend); the `emu` backend (emu_backend) compiles the same text for the CPU to test it."""
