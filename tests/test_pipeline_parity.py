"""Pipeline-parallel GPT-2 and Llama specs (1F1B, interleaved, GPipe, ZB-H1, ZBV; with TP) vs
the single-stage model.

Every rank also builds the whole model (same init seed) in-process and runs the global
batch of m microbatches as one batch; the pipelined step must give the same per-microbatch
losses on every rank, and every parameter the same gradient (gathered over TP; both copies
of the tied embedding hold the total grad after allreduce_shared_embedding_grads, and the
last stage's copy, scrambled, is restored by sync_shared_embedding), within 1e-5 relative. One rank-pool task per world size runs every configuration.
"""
import contextlib
import dataclasses
import functools

import pytest
import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.device import current_device
from megalite.distributed.finalize import finalize_model_grads, sync_shared_embedding
from megalite.models import GPTModel
from megalite.models.stage import build_model_chunks, shared_embedding_params
from megalite.mpu import comm, destroy_model_parallel, initialize_model_parallel
from megalite.mpu.layers import gather_tensor_parallel
from megalite.schedules import get_forward_backward_func
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err

CONFIG = ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=97,
                     max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
# Llama spec: RMSNorm, rope, SwiGLU, GQA (2 groups: split at TP 2), no biases, untied head
LLAMA = dataclasses.replace(
    CONFIG, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
    ffn_hidden_size=48, group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
    untie_embeddings_and_output_weights=True)
MODELS = {"gpt2": CONFIG, "llama": LLAMA}
SEQ, MICRO, SEED, TOL = 8, 2, 1234, 1e-5


class Recorder(nn.Module):
    """Stand-in for a data-parallel wrapper: logs, per backward, whether it ran in no_sync."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.in_no_sync, self.log = module, False, []

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False

    def forward(self, *args):
        out = self.module(*args)
        if out.requires_grad:
            out.register_hook(lambda grad: self.log.append(self.in_no_sync))
        return out


def batch(m: int) -> torch.Tensor:
    """The global batch: m microbatches of MICRO sequences of SEQ + 1 tokens, on this
    process's device."""
    return torch.randint(0, CONFIG.vocab_size, (m * MICRO, SEQ + 1),
                         generator=torch.Generator().manual_seed(m)).to(current_device())


def loss_func(per_token: torch.Tensor):
    loss = per_token.mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, chunk: nn.Module):
    tokens = next(data_iterator)
    return chunk(tokens[:, :-1], tokens[:, 1:]), loss_func


def provider(config: ModelConfig, pre_process: bool, post_process: bool) -> nn.Module:
    return Recorder(GPTModel(config, pre_process, post_process, init_seed=SEED,
                             device=current_device()))


def reference(m: int, model_name: str = "gpt2") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Single-stage model on the whole batch: per-microbatch losses [m], grads of the mean."""
    initialize_model_parallel(1, 1)
    config = MODELS[model_name]
    model = GPTModel(config, layer_range=(0, config.num_layers), init_seed=SEED,
                     device=current_device())
    tokens = batch(m)
    per_token = model(tokens[:, :-1], tokens[:, 1:])
    per_token.mean().backward()
    grads = {name: gather_tensor_parallel(param.grad, param)
             for name, param in model.named_parameters()}
    destroy_model_parallel()
    return per_token.detach().reshape(m, -1).mean(1), grads


def pipelined(refs: dict, tp: int, pp: int, vpp: int | None, m: int,
              schedule: str = "1f1b", model_name: str = "gpt2") -> dict:
    """Errors of one pipelined step and one forward-only step against `refs[m, model_name]`."""
    initialize_model_parallel(tp, pp, vpp, v_shape_placement=schedule == "zbv")
    chunks = build_model_chunks(functools.partial(provider, MODELS[model_name]))
    for weight in shared_embedding_params(chunks):  # sync_shared_embedding must undo this
        if getattr(weight, "shared_embedding_copy", False):
            weight.data.normal_()
    sync_shared_embedding(chunks)
    step = get_forward_backward_func(schedule)
    kw = dict(forward_step_func=forward_step, model=chunks, num_microbatches=m,
              seq_length=SEQ, micro_batch_size=MICRO)
    ref_losses, ref_grads = refs[m, model_name]
    eval_losses = step(data_iterator=iter(batch(m).split(MICRO)), forward_only=True, **kw)
    untouched = all(p.grad is None for c in chunks for p in c.parameters())
    losses = step(data_iterator=iter(batch(m).split(MICRO)), **kw)
    finalize_model_grads(chunks)
    grads = {name: gather_tensor_parallel(param.grad, param)
             for chunk in chunks for name, param in chunk.module.named_parameters()}
    destroy_model_parallel()
    as_tensor = lambda ls: torch.stack([d["lm loss"] for d in ls])  # noqa: E731
    return {
        "loss": rel_err(as_tensor(losses), ref_losses),
        "eval loss": rel_err(as_tensor(eval_losses), ref_losses),
        "grad": max(rel_err(g, ref_grads[name]) for name, g in grads.items()),
        "names": sorted(grads),
        "all names": sorted(ref_grads),
        "no_sync": all(c.log == [True] * (m - 1) + [False] for c in chunks),
        "eval left grads untouched": untouched,
    }


def clear_errors() -> dict[str, tuple[str, dict]]:
    """The one-line ValueErrors, and the bytes moved before each was raised."""
    out = {}
    initialize_model_parallel(1, 4, 2)
    bad = dataclasses.replace(CONFIG, num_layers=12)
    with comm.count_bytes() as moved:
        try:
            build_model_chunks(lambda pre_process, post_process: GPTModel(
                bad, pre_process, post_process, device=current_device()))
        except ValueError as e:
            out["layers"] = (str(e), dict(moved))
    chunks = build_model_chunks(functools.partial(provider, CONFIG))
    with comm.count_bytes() as moved:
        try:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None,
                                        model=chunks, num_microbatches=6, seq_length=SEQ,
                                        micro_batch_size=MICRO)
        except ValueError as e:
            out["microbatches"] = (str(e), dict(moved))
    destroy_model_parallel()
    return out


def run_grid(configs: list[tuple]) -> dict:
    keys = {(c[3], c[5] if len(c) > 5 else "gpt2") for c in configs}
    refs = {key: reference(*key) for key in keys}
    results = {str(c): pipelined(refs, *c) for c in configs}
    results["errors"] = clear_errors()
    return results


# (tp, pp, vpp, m[, schedule[, model]]); (1, 1, None, 4) is plain gradient accumulation
GRID_4 = [(1, 1, None, 4), (1, 4, None, 8, "gpipe")] + \
    [(1, pp, vpp, m) for pp in (2, 4) for vpp in (None, 2) for m in (pp, 2 * pp)] + \
    [(2, 2, vpp, m) for vpp in (None, 2) for m in (2, 4)] + \
    [(1, 4, None, 8, "zb-h1"), (1, 2, None, 2, "zb-h1"), (1, 4, 2, 8, "zbv"), (1, 2, 2, 3, "zbv"),
     (2, 2, None, 4, "zb-h1"), (2, 2, 2, 4, "zbv")] + \
    [(1, 2, 2, 4, "1f1b", "llama"), (2, 2, None, 4, "1f1b", "llama"),
     (1, 2, None, 4, "zb-h1", "llama"), (1, 2, 2, 4, "zbv", "llama")]
GRID_8 = [(2, 4, vpp, m) for vpp in (None, 2) for m in (4, 8)] + \
    [(2, 4, None, 4, "zb-h1"), (2, 4, 2, 8, "zbv")] + \
    [(4, 2, None, 4, "1f1b", "llama")]  # TP 4 > 2 KV groups: replicated K/V


@pytest.fixture(scope="module", params=[(4, GRID_4), (8, GRID_8)], ids=["4 ranks", "8 ranks"])
def results(request) -> list[dict]:
    world, configs = request.param
    return run_on_ranks(world, run_grid, configs)


def configs(per_rank: dict):
    return [(name, e) for name, e in per_rank.items() if name != "errors"]


def test_losses_and_grads_match_single_stage(results):
    for rank, per_rank in enumerate(results):
        for name, e in configs(per_rank):
            assert e["loss"] < TOL and e["grad"] < TOL, (rank, name, e)
    for name, e in configs(results[0]):
        covered = {n for per_rank in results for n in per_rank[name]["names"]}
        assert covered == set(e["all names"]), name
    print({name: "loss {:.1e}, grad {:.1e}".format(
        *(max(per_rank[name][k] for per_rank in results) for k in ("loss", "grad")))
        for name, _ in configs(results[0])})


def test_forward_only_matches_and_leaves_no_grads(results):
    for rank, per_rank in enumerate(results):
        for name, e in configs(per_rank):
            assert e["eval loss"] < TOL and e["eval left grads untouched"], (rank, name, e)


def test_all_but_each_chunks_last_backward_run_in_no_sync(results):
    for rank, per_rank in enumerate(results):
        for name, e in configs(per_rank):
            assert e["no_sync"], (rank, name)


def test_clear_errors_before_any_communication(results):
    for per_rank in results:
        errors = per_rank["errors"]
        layers, moved = errors["layers"]
        assert "--num-layers (12)" in layers and "= 8" in layers and "\n" not in layers
        assert not any(moved.values()), moved
        microbatches, moved = errors["microbatches"]
        assert "multiple of p=4" in microbatches and "\n" not in microbatches
        assert not any(moved.values()), moved
