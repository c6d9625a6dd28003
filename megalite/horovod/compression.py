"""Gradient compression for the wire, as Horovod's `hvd.Compression.none` / `.fp16`.

A compressor is a class with two static methods: `compress(tensor) -> (tensor, ctx)` before
the collective and `decompress(tensor, ctx) -> tensor` after it.
"""
import torch


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Sends floating-point tensors as fp16 (half the bytes) and restores their dtype after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The compressors DistributedOptimizer and allreduce accept (`compression=`)."""

    none = NoneCompressor
    fp16 = FP16Compressor
