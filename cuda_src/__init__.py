"""Raw CUDA sources (`*.cu`, `*.cuh`), read as package data and compiled at run time."""
