"""The `torch` backend (torch_backend.TorchKernels): the torch references of every op
(torch_attention, torch_decoder, torch_dense: the definitions the other backends are tested
against) and the CPU fast paths it takes (linear, weight_only_linear, cpu_attention), which call
the native CPU layer (runtime.kernels.cpu) where it runs."""
