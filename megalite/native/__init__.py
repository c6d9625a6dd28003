"""Host kernels in C, compiled once per machine on first use and loaded with ctypes: the
compressed all-reduce's sign packing (megalite/distributed/signs.c) and the MoE router's
top-k choice (megalite/moe/routing.c). CUDA tensors keep the torch ops; so does a machine
without a C compiler (one warning)."""
from megalite.native.build import INT64, POINTER, check_host, load

__all__ = ["INT64", "POINTER", "check_host", "load"]
