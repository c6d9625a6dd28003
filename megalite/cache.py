"""megalite's cache directory: `$MEGALITE_CACHE`, or `~/.cache/megalite` (the built-in
corpus, the compiled host kernels of the compressed all-reduce)."""
import os


def cache_root() -> str:
    """`$MEGALITE_CACHE` if set, else `~/.cache/megalite`."""
    return os.environ.get("MEGALITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "megalite")
