"""fp16 loss scalers with Megatron's semantics (bf16 and fp32 use none)."""
from megalite.config import PrecisionConfig


class ConstantGradScaler:
    """A fixed loss scale (`--loss-scale`); overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    @property
    def at_minimum(self) -> bool:
        """A fixed scale never drops: an overflow here cannot resolve itself."""
        return True

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


class DynamicGradScaler:
    """Dynamic loss scale, as Megatron's DynamicGradScaler.

    An overflowing step resets the growth count and uses up one unit of hysteresis; once
    `hysteresis` overflows have happened since the last growth, every further overflow
    multiplies the scale by `backoff_factor` (not below `min_scale`). After `growth_interval`
    consecutive clean steps the scale grows by `growth_factor` and the hysteresis refills.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2) -> None:
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    @property
    def at_minimum(self) -> bool:
        """True once backing off can no longer lower the scale."""
        return self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.growth_tracker = state["growth_tracker"]
        self.hysteresis_tracker = state["hysteresis_tracker"]


def build_grad_scaler(precision: PrecisionConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    """fp16: a constant scaler if --loss-scale is given, else a dynamic one; otherwise None."""
    if not precision.fp16:
        return None
    if precision.loss_scale is not None:
        return ConstantGradScaler(precision.loss_scale)
    return DynamicGradScaler(precision.initial_loss_scale, precision.min_loss_scale,
                             growth_interval=precision.loss_scale_window,
                             hysteresis=precision.hysteresis)
