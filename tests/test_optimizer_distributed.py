"""The distributed optimizer (ZeRO-1) against the non-sharded optimizer, and state round trips.

On 4 ranks, layouts DP 4, DP 2 (two groups of 2) and TP 2 x DP 2: the same model, batches
and DDP settings, AdamW for 5 steps, with and without sharding. fp32: params within 1e-6
relative after every step (~2e-7 seen). The two differ only in how a bucket is reduced
(on GPUs reduce-scatter vs all-reduce: grads differ by ~1e-10 at DP 4, summation order; on
the CPU both all-reduce) and in the order the norm is summed. Adam eps is 1e-5: Adam moves an element by
lr * g / (|g| + eps), and the attention key bias has a true grad of 0 (softmax ignores a
shift), so its computed grad is that rounding noise; with eps 1e-8 Adam amplifies it into
1e-4 relative parameter differences (measured), with 1e-5 it stays below 1e-6.
bf16 at DP 4: within one bf16 ulp (2^-8 relative; the fp32 main params round to the same
bf16 unless they sit on a rounding boundary; ~1e-6 seen). Optimizer state bytes per rank (exp_avg, exp_avg_sq, step, and the
fp32 main params under bf16) are 1/DP of the non-sharded optimizer's within 5% (bucket
padding, per-fragment step counters).

Checkpoint: a state_dict taken after 3 steps, loaded with the model params into a fresh
model and optimizer, continues to exactly the same params after 5 steps (both optimizers).

ZeRO-1's CPU all-reduce changes no bit (TP 2 x DP 2, fp32 and bf16, 2 steps): on the CPU its
buckets all-reduce instead of reduce-scattering (gloo's reduce-scatter is slower); params
equal those of an explicit reduce-scatter, with and without the host offload (compared on
the CPU only: on a GPU the offload steps on another device).
"""
import io

import torch
import torch.distributed as dist

from megalite.config import PrecisionConfig
from megalite.device import current_device
from megalite.distributed.reducers import GradReducer
from megalite.mpu import parallel_state as ps
from tests.helpers.multirank import run_on_ranks
from tests.helpers.dp_reference import (batches, build, full_params, init_grid, local_slice,
                                  max_rel_err, opt_config, rank_group, train_step)

STEPS, RESUME_AT, GLOBAL_BATCH = 5, 3, 8


def _opt(sharded: bool):
    return opt_config(use_distributed_optimizer=sharded, adam_eps=1e-5)


def state_bytes(optimizer) -> int:
    """Bytes of the torch optimizer state plus fp32 main params that are separate copies."""
    state = sum(t.numel() * t.element_size() for s in optimizer.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t))
    return state + sum(f.main.numel() * 4 for f in optimizer.fragments if f.target is not None)


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _compare(tp: int, dp: int, precision: PrecisionConfig) -> dict:
    init_grid(tp)
    group = ps.get_data_parallel_group() if tp * dp == 4 else rank_group(dp)
    runs = {sharded: build(precision, group, _opt(sharded))
            for sharded in (False, True)}
    resumed, err = {}, 0.0
    for step, tokens in enumerate(batches(STEPS, GLOBAL_BATCH)):
        if step == RESUME_AT:
            for sharded, (model, optimizer) in runs.items():
                fresh = build(precision, group, _opt(sharded))
                for p, q in zip(fresh[0].parameters(), model.parameters()):
                    p.data.copy_(q.data)
                fresh[1].load_state_dict(_round_trip(optimizer.state_dict()))
                resumed[sharded] = fresh
        for model, optimizer in list(runs.values()) + list(resumed.values()):
            assert train_step(model, optimizer, local_slice(tokens, group))[0]
        err = max(err, max_rel_err(full_params(runs[True][0]), full_params(runs[False][0])))
    return {"err": err,
            "state_ratio": state_bytes(runs[True][1]) / state_bytes(runs[False][1]),
            "resume_err": max(max_rel_err(full_params(resumed[s][0]), full_params(runs[s][0]))
                              for s in (False, True))}


def _suite() -> dict:
    fp32, bf16 = PrecisionConfig(), PrecisionConfig(bf16=True)
    return {(tp, dp, "bf16" if p.bf16 else "fp32"): _compare(tp, dp, p)
            for tp, dp, p in [(1, 4, fp32), (1, 2, fp32), (2, 2, fp32), (1, 4, bf16)]}


def test_distributed_optimizer_matches_plain_and_shards_state():
    results = run_on_ranks(4, _suite)
    for rank, per_layout in enumerate(results):
        for (tp, dp, dtype), r in per_layout.items():
            assert r["err"] < (1e-6 if dtype == "fp32" else 2 ** -8), (rank, tp, dp, dtype, r)
            assert abs(r["state_ratio"] * dp - 1) < 0.05, (rank, tp, dp, dtype, r)
            assert r["resume_err"] == 0.0, (rank, tp, dp, dtype, r)
    print("distributed vs plain optimizer (rank 0):", results[0])


class _ReduceScatter(GradReducer):
    """The sharded bucket's reduction as it runs on GPUs: only this rank's shard summed."""

    def start(self, flat: torch.Tensor, group) -> object:
        n, rank = flat.numel() // dist.get_world_size(group), dist.get_rank(group)
        return dist.reduce_scatter_single(flat[rank * n:(rank + 1) * n], flat, group=group,
                                          async_op=True)


def _cpu_all_reduce_changes_no_bit() -> dict:
    init_grid(2)
    group = ps.get_data_parallel_group()
    results = {}
    for precision in (PrecisionConfig(), PrecisionConfig(bf16=True)):
        runs = {"reduce-scatter": build(precision, group, _opt(True)),
                "default": build(precision, group, _opt(True))}
        if current_device().type == "cpu":
            runs["offload"] = build(precision, group, opt_config(
                use_distributed_optimizer=True, adam_eps=1e-5, optimizer_cpu_offload=True))
        for bucket in runs["reduce-scatter"][0].buckets():
            bucket.reducer = _ReduceScatter()
        for tokens in batches(2, GLOBAL_BATCH):
            for model, optimizer in runs.values():
                assert train_step(model, optimizer, local_slice(tokens, group))[0]
        want = full_params(runs["reduce-scatter"][0])
        for name, (model, _) in runs.items():
            got = full_params(model)
            results[name, "bf16" if precision.bf16 else "fp32"] = [
                n for n in want if not torch.equal(got[n], want[n])]
    return results


def test_zero1_cpu_all_reduce_keeps_params_bit_identical():
    for rank, results in enumerate(run_on_ranks(4, _cpu_all_reduce_changes_no_bit)):
        assert len(results) in (4, 6), results
        assert all(differ == [] for differ in results.values()), (rank, results)
