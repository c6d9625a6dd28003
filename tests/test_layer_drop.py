"""Progressive layer dropping (--progressive-layer-drop, megalite.models.layer_drop).

- The keep decisions equal an independent reference written here from the schedule
  (θ(t) = (1-θ̄)e^(-γt) + θ̄, p_l = 1 - (l/L)(1 - θ(t)), the documented seed mix), differ
  across DP replicas, and the share of layers kept over 2,000 draws matches Σ p_l / L within
  sampling error (5 sigma).
- One step at TP2 x PP2 x DP2 with sequence parallelism (also with full recompute, with VPP 2,
  and TP2 x CP2 x PP2) equals one process that runs each replica's microbatches with that
  replica's decisions (fp32, 1e-5 relative), at a step where some microbatch drops all of a
  pipeline stage's layers.
- Through pretrain_gpt: θ̄ = 1 (never drop) equals the run without the flag bit for bit; with
  dropping the log shows θ(t) and the share of layers computed, and runs with ZeRO-1/2/3
  and MoE layers (EP 2) train; a resumed run equals the straight one bit for bit.
- Evaluation (and so generation) runs every layer; BERT is refused with one line; FLOPs count
  only the layers run.
"""
import math
import re

import pytest
import torch

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.models import GPTModel
from megalite.models.layer_drop import LayerDrop, start_layer_drop
from megalite.mpu import destroy_model_parallel, initialize_model_parallel
from megalite.mpu import parallel_state as ps
from megalite.mpu.layers import gather_tensor_parallel
from megalite.planning.flops import flops_per_iteration
from tests.helpers.gpt_run import make_dataset, tiny_args, train, train_with_grad_norms
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import (GPT2, MICRO, MICROBATCHES, SEED, global_batch,
                                         parallel_step, with_)
from tests.helpers.reference import rel_err

SCHEDULE = LayerDrop(theta=0.2, gamma=0.01, seed=SEED, num_layers=4)


def reference_decisions(theta_bar: float, gamma: float, seed: int, layers: int, step: int,
                        microbatch: int, replica: int) -> list[bool]:
    """The schedule from its equations; the generator seed is the documented mix."""
    theta = (1 - theta_bar) * math.exp(-gamma * step) + theta_bar
    mixed = seed
    for value in (step, microbatch, replica):
        mixed = (mixed * 1_000_003 + value + 1) % (2 ** 63 - 25)
    draws = torch.rand(layers, generator=torch.Generator().manual_seed(mixed),
                       dtype=torch.float64)
    return [draws[l - 1].item() < 1 - (l / layers) * (1 - theta) for l in range(1, layers + 1)]


def test_decisions_equal_the_formula_and_differ_across_replicas():
    schedule = LayerDrop(theta=0.5, gamma=0.001, seed=7, num_layers=12)
    for step in (0, 10, 1000, 5000):
        for microbatch in range(3):
            for replica in range(3):
                assert schedule.decisions(step, microbatch, replica) == reference_decisions(
                    0.5, 0.001, 7, 12, step, microbatch, replica)
    assert all(schedule.decisions(0, k, r) == [True] * 12 for k in range(5) for r in range(3))
    late = [schedule.decisions(5000, k, r) for k in range(4) for r in range(2)]
    assert len({tuple(d) for d in late}) > 1
    assert schedule.decisions(5000, 0, 0) != schedule.decisions(5000, 0, 1)


def test_share_of_layers_kept_matches_the_expectation():
    schedule = LayerDrop(theta=0.5, gamma=0.001, seed=3, num_layers=12)
    step, draws = 700, 2000
    p = schedule.keep_probabilities(step)
    kept = sum(sum(schedule.decisions(step, k, 0)) for k in range(draws)) / (draws * 12)
    expected = sum(p) / 12
    sigma = math.sqrt(sum(q * (1 - q) for q in p) / draws) / 12
    assert abs(kept - expected) < 5 * sigma, (kept, expected, sigma)
    assert schedule.layer_shares(step, draws, 1) == pytest.approx(
        [sum(schedule.decisions(step, k, 0)[layer] for k in range(draws)) / draws
         for layer in range(12)])


def _pick_step() -> int:
    """The first step from 1000 at which, over 2 replicas x 2 microbatches, some microbatch
    drops both layers of stage 0, some both of stage 1, and the replicas' decisions differ."""
    for step in range(1000, 3000):
        draws = {(r, k): SCHEDULE.decisions(step, k, r) for r in range(2) for k in range(2)}
        if any(d[:2] == [False, False] for d in draws.values()) and \
                any(d[2:] == [False, False] for d in draws.values()) and \
                draws[0, 0] != draws[1, 0]:
            return step
    raise AssertionError("no such step")


def _reference(config: ModelConfig, step: int, dp: int = 2) -> tuple[float, dict]:
    """One process: each of `dp` replicas' microbatches with that replica's decisions."""
    initialize_model_parallel(1, 1)
    model = GPTModel(config, layer_range=(0, config.num_layers), init_seed=SEED,
                     device=current_device())
    start_layer_drop([model], SCHEDULE, 0, step)
    losses = []
    for replica, rows in enumerate(global_batch(dp).split(MICROBATCHES * MICRO)):
        for microbatch, tokens in enumerate(rows.split(MICRO)):
            model.encoder.layer_drop.replica = replica
            model.encoder.layer_drop.microbatch = microbatch
            losses.append(model(tokens[:, :-1], tokens[:, 1:]).float().mean())
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {n: gather_tensor_parallel(p.grad, p) for n, p in model.named_parameters()}
    destroy_model_parallel()
    return loss.item(), grads


def _with_layer_drop(step: int):
    def load(chunks):
        start_layer_drop(chunks, SCHEDULE, ps.get_data_parallel_rank(), step)
    return load


def _parity_cases() -> dict:
    step = _pick_step()
    cases = {"tp2 pp2 dp2 sp": (GPT2, 2, 2, 1, True, None),
             "tp2 pp2 dp2 sp recompute": (with_(GPT2, recompute_granularity="full"),
                                          2, 2, 1, True, None),
             "tp2 pp2 vpp2 dp2": (GPT2, 2, 2, 1, False, 2),
             "tp2 cp2 pp2": (GPT2, 2, 2, 2, False, None)}
    out = {}
    for name, (config, tp, pp, cp, sp, vpp) in cases.items():
        ref_loss, ref_grads = _reference(config, step, 8 // (tp * pp * cp))
        got = parallel_step(config, tp, pp, cp, sp, vpp, load=_with_layer_drop(step),
                            overlap_grad_reduce=False)
        out[name] = {"loss": abs(got["loss"] - ref_loss) / abs(ref_loss),
                     "grad": max(rel_err(g, ref_grads[n]) for n, g in got["grads"].items())}
    full = parallel_step(GPT2, 2, 2, 1, True)["loss"]
    out["dropping changed the loss"] = abs(full - _reference(GPT2, step)[0]) > 1e-3
    return out


def test_tp2_pp2_dp2_equals_one_process_with_the_same_decisions():
    results = run_on_ranks(8, _parity_cases)
    for rank, per_rank in enumerate(results):
        assert per_rank.pop("dropping changed the loss"), rank
        for name, e in per_rank.items():
            assert e["loss"] < 1e-5 and e["grad"] < 1e-5, (rank, name, e)
    print({name: "loss {:.1e}, grad {:.1e}".format(e["loss"], e["grad"])
           for name, e in results[0].items()})


def test_flops_count_only_the_layers_run():
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97)
    full = flops_per_iteration(config, 8, 16, 128)
    none = flops_per_iteration(config, 8, 16, 128, [0.0] * 4)
    half = flops_per_iteration(config, 8, 16, 128, [1.0, 0.5, 0.5, 0.0])
    assert full == flops_per_iteration(config, 8, 16, 128, [1.0] * 4)
    assert half == pytest.approx(none + (full - none) * 2 / 4)


def _train_logging(argv: list[str]) -> tuple[dict, dict, list[str]]:
    """pretrain_gpt in this process: (losses, grad norms, the log lines of rank 0)."""
    from megalite.training import logger
    lines, log = [], logger.log
    logger.log = lambda message: (lines.append(message), log(message))
    try:
        losses, norms = train_with_grad_norms(argv)
    finally:
        logger.log = log
    return losses, norms, lines


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("pld_data")))


def test_theta_one_equals_the_run_without_dropping_bit_for_bit(tmp_path, data):
    layout = ["--tp", "2", "--pp", "2", "--sequence-parallel"]
    plain = run_on_ranks(4, train_with_grad_norms, tiny_args(data, f"{tmp_path}/a", 3, *layout))
    never = run_on_ranks(4, train_with_grad_norms, tiny_args(
        data, f"{tmp_path}/b", 3, *layout, "--progressive-layer-drop", "--pld-theta", "1"))
    assert plain[0] == never[0]


@pytest.mark.parametrize("layout", [
    ["--pp", "2", "--dp", "2", "--use-distributed-optimizer", "--recompute-granularity", "full"],
    ["--dp", "4", "--data-parallel-sharding-strategy", "optim_grads_params"],
    ["--dp", "2", "--pp", "2", "--data-parallel-sharding-strategy", "optim_grads"],
    ["--pp", "2", "--dp", "2", "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2",
     "--moe-ffn-hidden-size", "16"]], ids=["zero1 pp2 recompute", "zero3", "zero2 pp2", "moe ep2"])
def test_dropping_trains_and_logs_theta_and_layers_computed(tmp_path, data, layout):
    argv = tiny_args(data, f"{tmp_path}/run", 4, *layout, "--progressive-layer-drop",
                     "--pld-gamma", "0.5", "--log-interval", "2")
    losses, norms, lines = run_on_ranks(4, _train_logging, argv)[0]
    assert list(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    logged = [line for line in lines if line.startswith("iteration")]
    theta = [float(re.search(r"pld theta ([0-9.]+)", line).group(1)) for line in logged]
    shares = [float(re.search(r"layers computed ([0-9.]+)", line).group(1)) for line in logged]
    schedule = LayerDrop(0.5, 0.5, 1234, 4)
    assert theta == pytest.approx([schedule.theta_at(1), schedule.theta_at(3)], abs=1e-4)
    assert all(0 < share < 1 for share in shares), shares


def _straight_and_resumed(prefix: str, root: str) -> tuple[dict, dict]:
    flags = ["--pp", "2", "--dp", "2", "--progressive-layer-drop", "--pld-gamma", "0.5"]
    straight = train(tiny_args(prefix, f"{root}/straight", 4, *flags))
    train(tiny_args(prefix, f"{root}/resumed", 4, "--exit-interval", "2", *flags))
    resumed = train(tiny_args(prefix, f"{root}/resumed", 4, "--load", f"{root}/resumed", *flags))
    return straight, resumed


def test_resume_draws_the_same_decisions(tmp_path, data):
    straight, resumed = run_on_ranks(4, _straight_and_resumed, data, str(tmp_path))[0]
    assert sorted(resumed) == [3, 4]
    assert [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)], (straight, resumed)


def _eval_and_generation_run_every_layer() -> bool:
    initialize_model_parallel(1, 1)
    model = GPTModel(GPT2, layer_range=(0, 4), init_seed=SEED, device=current_device())
    tokens = global_batch(1)[:, :-1]
    model.eval()
    full = model(tokens)
    start_layer_drop([model], SCHEDULE, 0, 2000)
    with torch.no_grad():
        same = torch.equal(model(tokens), full)
    model.train()
    differs = not torch.equal(model(tokens), full)
    destroy_model_parallel()
    return same and differs


def test_off_in_evaluation_and_generation():
    assert run_on_ranks(1, _eval_and_generation_run_every_layer) == [True]


def test_post_ln_bert_is_refused_with_one_line():
    from megalite.config import parse_configs
    from megalite.models.layer_drop import check_layer_drop
    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--vocab-size", "97", "--progressive-layer-drop"]
    with pytest.raises(ValueError, match="^--progressive-layer-drop: needs Pre-LN"):
        check_layer_drop(parse_configs(shape + ["--post-layernorm"]))
    with pytest.raises(ValueError, match="^--pld-theta 0.0: expected 0 < theta <= 1"):
        check_layer_drop(parse_configs(shape + ["--pld-theta", "0"]))
