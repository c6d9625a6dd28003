"""DistributedDataParallel: DP-mean gradients and parameters equal the single-process model's.

fp32 on 4 ranks: DP 4 (the world) and DP 2 (two independent groups of 2), each with one
microbatch and with 4 accumulated microbatches (no_sync on the first 3). After each of
3 steps on a global batch of 16, the main grads (before the step) and the params (after
it) equal a single process on the whole batch within 1e-5 relative (max |diff| / max |ref|
per tensor; ~1e-6 seen: fp32 summation order). The optimizer is SGD (lr 0.1, momentum,
clip 1.0), whose update is linear in the grad: AdamW divides each element by its own
|grad| and so turns the rounding noise of elements with |grad| ~ eps (the attention key
bias, whose true grad is 0; fresh zero biases) into O(lr) differences that no reduction
order can match. AdamW is compared layout against layout in test_optimizer_distributed.

Bucketing: with 1000-element buckets (9 of them) the recorded order of grad hooks and
reduction launches shows reductions starting while backward still produces grads, and
grads and params equal the one-bucket run's; with overlap off every launch comes after
the last grad (finish_grad_sync) and the numbers are the same again.
"""
from megalite.mpu import comm
from tests.helpers.multirank import run_on_ranks
from tests.helpers.dp_reference import (Reference, batches, build, compute_grads, full_params,
                                  init_grid, local_slice, max_rel_err, opt_config, rank_group)

STEPS, GLOBAL_BATCH = 3, 16


def _sgd(**kw):
    return opt_config(optimizer="sgd", lr=0.1, **kw)


def _parity(dp: int, microbatches: int) -> dict[str, float]:
    group = rank_group(dp)
    model, optimizer = build(group=group, opt=_sgd())
    ref = Reference(_sgd())
    errors = {"grad": 0.0, "param": 0.0}
    for tokens in batches(STEPS, GLOBAL_BATCH):
        _, ref_grads, _ = ref.grads(tokens)
        compute_grads(model, optimizer, local_slice(tokens, group), microbatches)
        errors["grad"] = max(errors["grad"], max_rel_err(full_params(model, grads=True), ref_grads))
        assert optimizer.step()[0]
        ref.step()
        errors["param"] = max(errors["param"], max_rel_err(full_params(model), ref.params()))
    return errors


def _recorded_run(**ddp_flags) -> tuple[list[str], dict, dict, int]:
    """(events in order: "grad" per param hook, "launch" per all-reduce on the DP group; main
    grads, params after one step, bucket count)."""
    group = rank_group(4)
    model, optimizer = build(group=group, opt=_sgd(**ddp_flags))
    events = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda _: events.append("grad"))
    all_reduce = comm.all_reduce

    def recording_all_reduce(tensor, group, *args, **kwargs):
        if group is model.data_parallel_group:
            events.append("launch")
        return all_reduce(tensor, group, *args, **kwargs)
    comm.all_reduce = recording_all_reduce
    try:
        compute_grads(model, optimizer, local_slice(batches(1, GLOBAL_BATCH)[0], group))
    finally:
        comm.all_reduce = all_reduce
    grads = full_params(model, grads=True)
    optimizer.step()
    return events, grads, full_params(model), len(model.buckets())


def _bucketing() -> dict:
    _, grads, params, one = _recorded_run()
    events, many_grads, many_params, many = _recorded_run(ddp_bucket_size=1000)
    off_events, off_grads, off_params, _ = _recorded_run(ddp_bucket_size=1000,
                                                         overlap_grad_reduce=False)
    return {"buckets": (one, many), "launches": events.count("launch"),
            "grads_after_first_launch": events[events.index("launch"):].count("grad"),
            "grads_after_first_launch_overlap_off":
                off_events[off_events.index("launch"):].count("grad"),
            "many_vs_one": max(max_rel_err(many_grads, grads), max_rel_err(many_params, params)),
            "off_vs_one": max(max_rel_err(off_grads, grads), max_rel_err(off_params, params))}


def _suite() -> dict:
    init_grid(1)
    parity = {(dp, m): _parity(dp, m) for dp in (2, 4) for m in (1, 4)}
    return {"parity": parity, "bucketing": _bucketing()}


def test_dp_matches_single_process_and_buckets_overlap_backward():
    results = run_on_ranks(4, _suite)
    for rank, res in enumerate(results):
        for (dp, m), e in res["parity"].items():
            assert e["grad"] < 1e-5 and e["param"] < 1e-5, (rank, dp, m, e)
        b = res["bucketing"]
        one, many = b["buckets"]
        assert one == 1 and many > 5, b
        assert b["launches"] == many, b
        assert b["grads_after_first_launch"] > 0, b
        assert b["grads_after_first_launch_overlap_off"] == 0, b
        assert b["many_vs_one"] < 1e-6 and b["off_vs_one"] < 1e-6, b
    print("DP parity and bucketing (rank 0):", results[0])
