"""Text generation: KV cache, sampling, batched generation under TP and PP."""
from megalite.inference.generation import (GenerationStats, check_prompts, generate,
                                           generate_steps)
from megalite.inference.kv_cache import KVCache
from megalite.inference.sampling import SamplingParams, filter_logits, sample

__all__ = ["GenerationStats", "KVCache", "SamplingParams", "check_prompts", "filter_logits",
           "generate", "generate_steps", "sample"]
