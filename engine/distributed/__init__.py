"""Tensor parallelism (Megatron-style, as vLLM and nano-vllm): `parallel_state` (the group and its collectives),
`sharding` (which slice of each weight a rank holds), `executor` (rank 0 drives the workers), `worker` (ranks
1..N-1), `start` (checks and spawns)."""
