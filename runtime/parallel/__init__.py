"""Tensor parallelism: the world (`world_config`), each rank's slices (`tensor_shard`), the collectives (`tensor_parallel`, `shm_collectives`)."""
