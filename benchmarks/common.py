"""What the benchmarks share: their command line, the machine line each prints first, timing,
and counters of host memory and of the bytes autograd saves.

    parser = benchmark_parser(__doc__, steps=8, hidden_size=256)  # standard flags, defaults
    print(machine_line())                                  # load average: timings need it
    seconds, loss = timed(step, device)                    # GPU work finished, ranks together
    for name in turn_order(steps, i): ...                  # each goes first every other round

A benchmark runs as a script (`python benchmarks/bench_gpt.py`), so this module is imported
as `common` from the script's own directory (rank pools' spawned workers inherit that path).
"""
import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")
STANDARD = {"ranks": "gloo ranks, one process each (OMP_NUM_THREADS=1)",
            "steps": "timed steps (after the warm-up)",
            "warmup": "untimed steps first",
            "repeats": "runs of each measurement, the best kept",
            "seed": "seed of the weights and the data",
            "num_layers": "transformer layers L", "hidden_size": "hidden size h",
            "num_attention_heads": "attention heads a", "vocab_size": "vocabulary size V",
            "seq_length": "tokens per sequence s", "micro_batch_size": "sequences per microbatch b",
            "batch_sizes": "prompts per generate call, one run each",
            "prompt_len": "tokens per prompt", "new_tokens": "tokens generated per prompt"}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, each flag's default after its help."""


def add_standard_flags(parser: argparse.ArgumentParser, device: str | None = None,
                       **defaults: int | list[int]) -> argparse.ArgumentParser:
    """Add the standard integer flags named in `defaults` with their defaults (a key of
    STANDARD: the run's ranks, steps, warm-up, repeats, seed; the model's shape, megalite's
    flag names; generation's prompts; a list default takes several values) and, given a
    default `device`, --device {cpu, cuda}."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            nargs="+" if isinstance(default, list) else None,
                            help=STANDARD[name])
    if device is not None:
        parser.add_argument("--device", default=device, choices=["cpu", "cuda"],
                            help="where the models run")
    return parser


def benchmark_parser(doc: str, device: str | None = None,
                     **defaults: int | list[int]) -> argparse.ArgumentParser:
    """A benchmark's parser: `doc` (its module docstring) as --help's description, and the
    standard flags of add_standard_flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=_HelpFormatter)
    return add_standard_flags(parser, device, **defaults)


def machine_line() -> str:
    """The load average (1, 5, 15 min) on this machine's cores: a time measured on a shared
    machine means little without the load beside it."""
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return f"load average {load} on {os.cpu_count()} cores"


def schedstat(pid: int | None = None) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) so far of the calling thread, or
    of process `pid`'s main thread, from Linux's /proc schedstat; what is left of a span's wall
    time the thread slept (blocked, e.g. waiting for a message). (0, 0) where the file does
    not exist."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat" if pid is None else \
        f"/proc/{pid}/schedstat"
    try:
        with open(path) as f:
            running, waiting = f.read().split()[:2]
    except OSError:
        return 0.0, 0.0
    return int(running) / 1e9, int(waiting) / 1e9


def sync(device: torch.device | None) -> None:
    """Wait for the work queued on `device` when it is a GPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device | None = None,
          barrier: bool = False) -> tuple[float, T]:
    """(wall seconds of fn(), its result): started after a barrier of the default process
    group when `barrier` (the ranks start together), ended when `device`'s work is done."""
    if barrier:
        torch.distributed.barrier()
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def median_seconds(step: Callable[[int], object], steps: int, warmup: int = 1,
                   device: torch.device | None = None, barrier: bool = False) -> float:
    """Median seconds of step(i) over the `steps` calls after `warmup` untimed ones (i counts
    every call from 0), each one `timed`."""
    times = [timed(lambda: step(i), device, barrier)[0] for i in range(warmup + steps)]
    return statistics.median(times[warmup:])


def turn_order(names: Iterable[T], round_index: int) -> list[T]:
    """`names` in order, reversed every other round: each goes first every other round, so a
    changing machine load hits them alike."""
    names = list(names)
    return names if round_index % 2 == 0 else names[::-1]


def plot_curves(curves: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str,
                path: str, **style) -> None:
    """One line per name of `curves` ({name: (x values, y values)}) into the PNG `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for name, (x, y) in curves.items():
        plt.plot(x, y, label=name, **style)
    plt.xlabel(xlabel)
    plt.ylabel(ylabel)
    plt.title(title)
    plt.legend()
    plt.savefig(path, dpi=100)
    print(f"wrote {path}")


def llama_shape_flags(num_layers: int, hidden_size: int, vocab_size: int) -> list[str]:
    """pretrain_gpt flags of a Llama-shaped model: heads of 64 (at least 2), SwiGLU's
    8h/3 rounded down to a multiple of 64."""
    return ["--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
            "--num-attention-heads", str(max(hidden_size // 64, 2)), "--ffn-hidden-size",
            str(8 * hidden_size // 3 // 64 * 64), "--vocab-size", str(vocab_size)]


def rss_bytes() -> int:
    """This process's resident set (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The largest rise of this process's resident set while entered (bytes, `rise`), sampled
    every 2 ms."""

    def __enter__(self) -> "PeakRss":
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.rise = self.peak - self.base


class SavedBytes:
    """Bytes of the storages autograd saves for backward while entered, once each, parameters
    excluded, by section: "layers" while `layers` (the transformer stack) runs its forward,
    "other" outside it (embedding, LM head, loss)."""

    def __init__(self, params: Iterable[torch.Tensor], layers: torch.nn.Module) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, tuple[str, int]] = {}
        self.section, self.layers = "other", layers

    def __enter__(self) -> "SavedBytes":
        self._hooks = [
            self.layers.register_forward_pre_hook(lambda *_: setattr(self, "section", "layers")),
            self.layers.register_forward_hook(lambda *_: setattr(self, "section", "other"))]
        self._saving = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._saving.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saving.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.excluded and ptr not in self.seen:
            self.seen[ptr] = (self.section, storage.nbytes())
        return tensor

    def total(self, section: str) -> int:
        return sum(n for s, n in self.seen.values() if s == section)
