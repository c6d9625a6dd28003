"""Faults injected through MEGALITE_FAULT (megalite.training.resilience) or real signals: a NaN loss
on one rank, SIGTERM mid-run, a rank SIGKILLed mid-step under torchrun while an asynchronous
save is in flight, a hung collective
(on NCCL with TORCH_NCCL_BLOCKING_WAIT=1, so the wait itself raises at the group's timeout
instead of NCCL's watchdog aborting the process)."""
import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megalite import checkpoint
from megalite.device import current_device
from megalite.distributed.rank_pool import on_gpus, run_once
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTANT_LR = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
PP2_DP2 = ["--pp", "2", "--dp", "2"]


def _with_faults(spec: str, argv: list[str]) -> tuple[dict, str | None]:
    """Train with MEGALITE_FAULT=spec on this rank; (losses, NonFiniteError text or None)."""
    from megalite.training.resilience import NonFiniteError
    os.environ["MEGALITE_FAULT"] = spec
    try:
        return train(argv), None
    except NonFiniteError as error:
        return {}, str(error)
    finally:
        del os.environ["MEGALITE_FAULT"]


def _nan_runs(prefix: str, root: str, layout: list[str]) -> tuple:
    """A clean run stopped after 2 steps, the same with a 3rd step whose loss is NaN on rank 3 only
    (last stage, DP rank 1), and a run stopped by two NaN steps in a row."""
    clean = train(tiny_args(prefix, f"{root}/clean", 3, *layout, *CONSTANT_LR,
                            "--exit-interval", "2"))
    skipped, _ = _with_faults("nan_loss@3:3", tiny_args(prefix, f"{root}/skip", 3, *layout,
                                                        *CONSTANT_LR))
    _, error = _with_faults("nan_loss@2:3,nan_loss@3:3", tiny_args(
        prefix, f"{root}/stop", 4, *layout, *CONSTANT_LR, "--save-interval", "1",
        "--max-skipped-steps", "2"))
    return clean, skipped, error


@pytest.mark.parametrize("layout", [PP2_DP2, PP2_DP2 + [
    "--data-parallel-sharding-strategy", "optim_grads_params"]], ids=["ddp", "zero3"])
def test_nan_loss_on_one_rank_skips_the_step_everywhere_and_stops_after_the_limit(tmp_path,
                                                                                  layout):
    """Under DDP and under ZeRO-3 (FSDP2: the NaN reaches every rank's shards through the
    reduce-scatter; the skip leaves the sharded weights untouched)."""
    prefix = make_dataset(str(tmp_path))
    clean, skipped, error = run_on_ranks(4, _nan_runs, prefix, str(tmp_path), layout)[0]
    assert [skipped[i] for i in (1, 2)] == [clean[i] for i in (1, 2)]
    assert skipped[3] != skipped[3]  # NaN, seen on rank 0 too (agreed over PP and DP)
    # the NaN step was never applied: the checkpoint written after it holds the weights of
    # the clean run after step 2, bit for bit, with no NaN
    _, clean_weights = checkpoint.read_full_model(str(tmp_path / "clean"))
    meta, skip_weights = checkpoint.read_full_model(str(tmp_path / "skip"))
    assert meta["iteration"] == 3 and clean_weights.keys() == skip_weights.keys()
    for name, tensor in clean_weights.items():
        assert torch.equal(tensor, skip_weights[name]), name
    assert error.startswith("iteration 3: 2 consecutive steps skipped (non-finite loss")
    # nothing saved after the first NaN: iteration 1 is still the newest checkpoint
    assert checkpoint.latest_iteration(str(tmp_path / "stop")) == 1


def _fp16_stuck(prefix: str, root: str) -> str:
    return _with_faults("nan_loss@1,nan_loss@2,nan_loss@3", tiny_args(
        prefix, f"{root}/fp16", 5, "--fp16", "--initial-loss-scale", "4", "--min-loss-scale",
        "1", "--hysteresis", "1", "--max-skipped-steps", "2"))[1]


def test_fp16_stuck_at_the_minimum_loss_scale_stops(tmp_path):
    prefix = make_dataset(str(tmp_path))
    error = run_on_ranks(1, _fp16_stuck, prefix, str(tmp_path))[0]
    # scale 4 -> 2 -> 1 (iterations 1, 2), then two skips at the minimum: iterations 2 and 3
    assert error.startswith("iteration 3: 2 consecutive steps skipped (fp16 overflow with the "
                            "loss scale stuck at its minimum 1;"), error


def _sigterm_run(prefix: str, root: str) -> tuple[list[int], bool]:
    """(iterations run, whether SIGTERM's default handler is back afterwards)."""
    losses = _with_faults("sigterm@3:1", tiny_args(prefix, f"{root}/term", 6))[0]
    return sorted(losses), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_on_one_rank_stops_every_rank_after_the_step_with_a_checkpoint(tmp_path):
    prefix = make_dataset(str(tmp_path))
    assert run_on_ranks(2, _sigterm_run, prefix, str(tmp_path)) == [([1, 2, 3], True)] * 2
    assert checkpoint.latest_iteration(str(tmp_path / "term")) == 3


def _hang_on_tp_group(timeout_s: float, store_path: str) -> tuple[float, str]:
    """Both ranks all-reduce once on the TP group (NCCL builds its communicator at the first
    collective, which no timeout bounds), then rank 0 again while rank 1 stays away until
    rank 0's collective has ended (a key in a file store), or 10 s at most."""
    import torch.distributed as dist

    from megalite.mpu import initialize_model_parallel
    from megalite.mpu import parallel_state as ps
    initialize_model_parallel(2, 1, timeout_s=timeout_s)
    ones, group = torch.ones(1, device=current_device()), ps.get_tensor_model_parallel_group()
    dist.all_reduce(ones, group=group)
    store = dist.FileStore(store_path, 2)
    if dist.get_rank() == 1:
        with contextlib.suppress(RuntimeError):  # a store timeout: rank 0 never came back
            store.wait(["ended"], datetime.timedelta(seconds=10))
        return 0.0, ""
    start = time.monotonic()
    try:
        dist.all_reduce(ones, group=group)
        outcome = "no error"
    except RuntimeError as error:
        outcome = str(error).splitlines()[0]
    elapsed = time.monotonic() - start
    store.set("ended", "1")
    return elapsed, outcome


def test_a_hung_tensor_parallel_collective_ends_within_the_group_timeout(tmp_path):
    elapsed, error = run_once(2, _hang_on_tp_group, 1.0, str(tmp_path / "store"), timeout=60,
                              env={"TORCH_NCCL_BLOCKING_WAIT": "1"})[0]
    assert error != "no error" and 0.9 < elapsed < 5, (elapsed, error)


def _resume(prefix: str, root: str, name: str, iters: int) -> dict:
    return train(tiny_args(prefix, f"{root}/{name}", iters, "--load", f"{root}/killed",
                           "--pp", "2"))


def test_sigkill_of_one_rank_during_an_async_save_leaves_the_previous_checkpoint_to_resume(
        tmp_path):
    """--async-save every step (PP 2 under torchrun): the save of step 3 is still unpublished
    (its files written in the background, published by the next save) when rank 1 dies in
    step 4, so step 2's checkpoint (published when the save of step 3 began) is what --load
    picks."""
    prefix = make_dataset(str(tmp_path))
    ck = tmp_path / "killed"
    argv = tiny_args(prefix, str(ck), 5, "--pp", "2", "--save-interval", "1", "--async-save",
                     "--distributed-timeout-minutes", "0.5")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGALITE_FAULT": "sigkill@4:1",
           **({} if on_gpus(2) else {"CUDA_VISIBLE_DEVICES": ""})}  # as the rank pools
    start = time.monotonic()
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", "pretrain_gpt.py", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=150)
    elapsed = time.monotonic() - start
    assert job.returncode != 0 and elapsed < 120, (job.returncode, elapsed)
    assert "SIGKILL" in job.stderr or "exitcode  : -9" in job.stderr, job.stderr[-2000:]
    assert checkpoint.latest_iteration(str(ck)) == 2
    assert not os.path.exists(checkpoint.iteration_dir(str(ck), 3))
    straight = run_on_ranks(2, train, tiny_args(prefix, str(tmp_path / "straight"), 5,
                                                "--pp", "2"))[0]
    resumed = run_on_ranks(2, _resume, prefix, str(tmp_path), "resumed", 5)[0]
    assert sorted(resumed) == [3, 4, 5]
    assert [resumed[i] for i in (3, 4, 5)] == [straight[i] for i in (3, 4, 5)]


@pytest.mark.parametrize("spec", ["nan@3", "nan_loss@x", "sigkill@3:r"])
def test_malformed_fault_spec_is_one_line(spec):
    from megalite.training.resilience import parse_faults
    with pytest.raises(ValueError, match="MEGALITE_FAULT") as error:
        parse_faults(spec)
    assert "\n" not in str(error.value)
