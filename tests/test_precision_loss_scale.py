"""fp16 dynamic loss scaling: Megatron's scaler semantics, and a skipped step everywhere.

Scaler alone: the scale backs off (x0.5) only once `hysteresis` overflows have happened
since the last growth, then on every overflow, never below min_scale; it doubles after
`loss_scale_window` consecutive clean steps, which also refills the hysteresis.

On 4 ranks (TP 2 x DP 2, fp16 params, initial scale 2^10, hysteresis 2, window 3), with
the plain and the distributed optimizer: an inf injected into one grad on global rank 1
only (TP rank 1 of DP replica 0) makes every rank skip the step (the DP all-reduce or
reduce-scatter carries it to rank 3, the model-parallel MAX to ranks 0 and 2) and leaves
the parameters bitwise unchanged; the first overflow keeps the scale (hysteresis), the
second halves it, and after 3 clean steps it doubles back.
"""
import torch

from megalite.config import PrecisionConfig
from megalite.mpu import parallel_state as ps
from megalite.optimizer import DynamicGradScaler
from tests.helpers.multirank import run_on_ranks
from tests.helpers.dp_reference import (batches, build, init_grid, local_slice, opt_config,
                                        train_step)

INITIAL = 2.0 ** 10
PRECISION = PrecisionConfig(fp16=True, initial_loss_scale=INITIAL, hysteresis=2,
                            loss_scale_window=3)
INJECT = (True, True, False, False, False)  # overflow on the first two steps


def test_dynamic_scaler_follows_megatron_semantics():
    scaler = DynamicGradScaler(8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    seen = []
    for found_inf in (True, True, True, True, False, False, True, False, False):
        scaler.update(found_inf)
        seen.append(scaler.scale)
    # inf: hysteresis 2 -> 1, keep 8; inf: -> 0, halve to 4; inf: 2; inf: floor 2;
    # two clean: double to 4, hysteresis back to 2; inf: 1 left, keep 4; two clean: 8.
    assert seen == [8, 4, 2, 2, 2, 4, 4, 4, 8], seen


def _run(sharded: bool) -> list[tuple[bool, float, bool]]:
    """Per step: (stepped, loss scale after it, params unchanged by it)."""
    group = ps.get_data_parallel_group()
    model, optimizer = build(PRECISION, opt=opt_config(use_distributed_optimizer=sharded))
    inject = [False]
    if torch.distributed.get_rank() == 1:
        weight = model.module.encoder.layers["0"].mlp.dense_h_to_4h.weight
        weight.register_hook(lambda g: torch.full_like(g, float("inf")) if inject[0] else None)
    out = []
    for tokens, overflow in zip(batches(len(INJECT), 8), INJECT):
        inject[0] = overflow
        before = [p.detach().clone() for p in model.parameters()]
        stepped, _ = train_step(model, optimizer, local_slice(tokens, group))
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        out.append((stepped, optimizer.loss_scale, unchanged))
    return out


def _suite() -> dict:
    init_grid(2)
    return {sharded: _run(sharded) for sharded in (False, True)}


def test_overflow_on_one_tp_rank_skips_the_step_on_every_rank():
    expected_scale = [INITIAL, INITIAL / 2, INITIAL / 2, INITIAL / 2, INITIAL]
    for rank, per_optimizer in enumerate(run_on_ranks(4, _suite)):
        for sharded, steps in per_optimizer.items():
            assert [s for s, _, _ in steps] == [not o for o in INJECT], (rank, sharded, steps)
            assert [u for _, _, u in steps] == list(INJECT), (rank, sharded, steps)
            assert [scale for _, scale, _ in steps] == expected_scale, (rank, sharded, steps)
