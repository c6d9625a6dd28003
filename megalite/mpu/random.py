"""Model-parallel RNG, weight-initialisation generators and activation checkpointing that
restores the RNG.

The default generator is seeded identically on the TP ranks of a stage, so dropout
outside TP regions (on replicated [s, b, h] activations) agrees across them. A second
named stream, seeded `seed + 2718 + tp_rank` (Megatron's offset), drives dropout inside
TP regions (attention probabilities of each rank's own heads), so it differs per rank.
Both run on the compute device (`RNGStatesTracker.device_type`).
`checkpoint` saves both streams at forward and replays them on recompute. Weights are drawn
from private CPU generators (`seeded`, `init_generator`), never from these streams.
"""
import contextlib
from collections.abc import Callable, Iterator

import torch

from megalite.device import device_type

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state() -> torch.Tensor:
    if device_type() == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG streams on the compute device (`device_type`: their states are that
    device's generator states), swapped in with `fork(name)`."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    @property
    def device_type(self) -> str:
        """Asked when used: importing this module touches no GPU (a fork server preloads it)."""
        return device_type()

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        """A stream seeded with `seed` (from a fresh generator: the global ones are untouched)."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.states[name] = torch.Generator(self.device_type).manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream `name`; its advanced state is kept for next time."""
        if name not in self.states:
            raise RuntimeError(f"RNG state {name!r} was never added (call model_parallel_seed)")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0) -> None:
    """Seed the default stream (same on TP ranks, offset per pipeline stage) and the TP stream."""
    torch.manual_seed(seed + 100 * pp_rank)
    if device_type() == "cuda":
        torch.cuda.manual_seed(seed + 100 * pp_rank)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank + 100 * pp_rank)


_init_generator: torch.Generator | None = None


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[torch.Generator]:
    """Weight initialisation inside the block draws from a private CPU generator seeded with
    `seed` (`init_generator()`, yielded too); the global generators, CPU and CUDA, are never
    touched.

    Every parameter's full value then depends only on (seed, its place in the model), never
    on the TP/PP layout or the device: weights are drawn on the CPU and then moved.
    """
    global _init_generator
    outer, _init_generator = _init_generator, torch.Generator().manual_seed(seed)
    try:
        yield _init_generator
    finally:
        _init_generator = outer


def init_generator() -> torch.Generator | None:
    """The CPU generator of the innermost `seeded` block; None outside one (draws then use the
    global CPU generator)."""
    return _init_generator


_skip_init = False


@contextlib.contextmanager
def weights_loaded_next() -> Iterator[None]:
    """The tensor-parallel weights built inside the block start at zero instead of being drawn
    (drawing means the full tensor on every TP rank: seconds for a 100M-parameter model), for
    a model whose weights are all loaded right after. No generator is touched."""
    global _skip_init
    outer, _skip_init = _skip_init, True
    try:
        yield
    finally:
        _skip_init = outer


def skips_init() -> bool:
    """Whether a `weights_loaded_next` block is open."""
    return _skip_init


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = _get_state()
        ctx.tracker_states = _TRACKER.get_states()
        with torch.no_grad():
            outputs = function(*args)
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        ctx.non_tensor = [None if torch.is_tensor(a) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else ctx.non_tensor[i]
                  for i, t in enumerate(saved)]
        now_cpu, now_device, now_tracker = torch.get_rng_state(), _get_state(), _TRACKER.get_states()
        torch.set_rng_state(ctx.cpu_state)
        _set_state(ctx.device_state)
        _TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        finally:
            torch.set_rng_state(now_cpu)
            _set_state(now_device)
            _TRACKER.set_states(now_tracker)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(i.grad if torch.is_tensor(i) else None for i in inputs)


def checkpoint(function: Callable, *args):
    """Run `function(*args)` without keeping activations; recompute them in backward with
    the CPU, device and tracker RNG states of the original forward (same dropout masks)."""
    return _CheckpointFunction.apply(function, *args)
