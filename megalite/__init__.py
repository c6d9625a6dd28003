"""megalite: a compact Megatron-style trainer with tensor, pipeline and data parallelism."""
__version__ = "0.1.0"
