"""Models built per pipeline stage / virtual chunk."""
from megalite.models.gpt import GPTModel

__all__ = ["GPTModel"]
