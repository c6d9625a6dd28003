"""bf16 and fp16 training track the fp32 loss curve.

A small GPT (TP 2 x DP 2 on 4 ranks) learns the rule x[t+1] = (5 x[t] + 3) mod 97 for 20
steps (AdamW, 3 warm-up steps, cosine decay from 3e-3 to 3e-4, clip 1.0), from the same
initial weights and batches in fp32, bf16 and fp16 (initial loss scale 2^16: Megatron's
2^32 would skip the first ~17 steps while the scale backs off, leaving nothing to
compare), with the plain and with the distributed optimizer. Tolerance per step, relative
to the fp32 loss: one ulp of the low-precision format (bf16 2^-8, fp16 2^-11), i.e. the
loss curves agree to the resolution of the parameter dtype (measured: bf16 ~1e-4, fp16
~2e-5). No fp16 step may be skipped and the loss must fall by at least 0.5.
"""
import torch

from megalite.config import PrecisionConfig
from megalite.device import current_device
from megalite.mpu import parallel_state as ps
from megalite.optimizer import OptimizerParamScheduler
from tests.helpers.multirank import run_on_ranks
from tests.helpers.dp_reference import (SEQ, VOCAB, build, compute_grads, init_grid, local_slice,
                                  opt_config)

STEPS, GLOBAL_BATCH = 20, 16
PRECISIONS = {"fp32": PrecisionConfig(), "bf16": PrecisionConfig(bf16=True),
              "fp16": PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 16)}
TOLERANCE = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def rule_batches(steps: int, size: int, seed: int = 3) -> list[torch.Tensor]:
    """Token sequences [size, SEQ + 1] following x[t+1] = (5 x[t] + 3) mod VOCAB, on this
    rank's device."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        columns = [torch.randint(0, VOCAB, (size,), generator=gen).to(current_device())]
        for _ in range(SEQ):
            columns.append((5 * columns[-1] + 3) % VOCAB)
        out.append(torch.stack(columns, dim=1))
    return out


def _curve(precision: PrecisionConfig, sharded: bool) -> tuple[list[float], int]:
    """(this rank's loss per step, skipped steps)."""
    config = opt_config(lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", lr_warmup_iters=3,
                        lr_decay_iters=STEPS, use_distributed_optimizer=sharded)
    model, optimizer = build(precision, opt=config)
    scheduler = OptimizerParamScheduler.from_config(optimizer, config, STEPS)
    losses, skipped = [], 0
    for tokens in rule_batches(STEPS, GLOBAL_BATCH):
        losses.append(compute_grads(model, optimizer,
                                    local_slice(tokens, ps.get_data_parallel_group())))
        stepped, _ = optimizer.step()
        if stepped:
            scheduler.step()
        skipped += not stepped
    return losses, skipped


def _suite() -> dict:
    init_grid(2)
    return {(name, sharded): _curve(p, sharded) for name, p in PRECISIONS.items()
            for sharded in (False, True) if name != "fp32" or not sharded}


def test_bf16_and_fp16_track_fp32_loss_curve():
    results = run_on_ranks(4, _suite)
    for rank, curves in enumerate(results):
        fp32, _ = curves[("fp32", False)]
        assert fp32[0] - fp32[-1] > 0.5, fp32
        for (name, sharded), (losses, skipped) in curves.items():
            assert skipped == 0, (rank, name, sharded, skipped)
            if name == "fp32":
                continue
            worst = max(abs(a - b) / b for a, b in zip(losses, fp32))
            assert worst < TOLERANCE[name], (rank, name, sharded, worst, losses, fp32)
    print("loss curves (rank 0):", {k: [round(x, 4) for x in v[0]] for k, v in results[0].items()})
