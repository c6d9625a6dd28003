"""Data pipeline: indexed datasets, tokenizers, GPT samples, blending, samplers, builtin corpus."""
