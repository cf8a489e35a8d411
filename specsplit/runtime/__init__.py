"""How a model runs: the KV cache, attention kernels, fused projections, the model runner, and
fixed-shape forwards replayed from CUDA graphs."""
