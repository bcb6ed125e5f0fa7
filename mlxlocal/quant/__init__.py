"""Quantization front ends: RTN / mixed recipes / AWQ to MLX checkpoints, and perplexity."""
