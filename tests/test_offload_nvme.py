"""The nvme tiers: the optimizer's (--optimizer-offload-device nvme, megalite.optimizer.nvme_tier)
and the parameters' (--param-offload-device, megalite.distributed.param_tier).

Parity: the loss and global grad-norm curves equal those of the same layout without offload
(fp32, Adam with clipping active, a constant learning rate; 3 steps) with the optimizer tier
at DP2 ZeRO-1, DP2 ZeRO-3 and at DP2 ZeRO-1 in bf16, whose fp32 masters live in the file; with
the parameter tier (nvme) at DP2 ZeRO-3; with both at DP2 and TP2 x PP2 x DP2 ZeRO-3. Sub-groups of
700 parameters: fragments span sub-groups and the three buffers are reused. Every run leaves
its scratch directories removed when train() returns (closed, not garbage collected).

Device-resident parameters, DP2 ZeRO-3: at each layer's forward (after the first step, whose
units start resident) the live storage bytes of all sharded parameters are at most the units
in flight, 2 layers' shards (the one gathering and the one read ahead; (12 h^2 + 13 h) * 4 /
DP bytes each), with the parameter tier alone and with both tiers; with both, at each
sub-group the optimizer steps, at most the units of two sub-groups (700 elements, less than
a layer's shard): 2 layers' shards and the root unit's (embedding, final norm).

Resume chain: a run with both nvme tiers at DP2 ZeRO-3 stopped by SIGTERM after step 2
(checkpoint read through the tiers), resumed without them at TP2 with the distributed
optimizer (state resharded), stopped at step 4, resumed with the optimizer's nvme tier and
the parameters' cpu tier at DP2 ZeRO-3 to step 6: the uninterrupted run's curve (1e-5: the
layouts sum in other orders).

Bad paths are one line before training: missing, not writable (simulated: root ignores
permissions) and too small for the planner's bytes (free space simulated).
"""
import contextlib
import functools
import os
import tempfile

import pytest
import torch.distributed as dist

from megalite.tasks import gpt as pretrain_gpt
from tests.helpers.gpt_run import make_dataset, tiny_args, train_with_grad_norms
from tests.helpers.multirank import run_on_ranks

EXACT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--lr-decay-style", "constant",
         "--lr-warmup-iters", "0", "--clip-grad", "0.05"]  # grad norm ~1.2: clipping on
ZERO1 = ["--use-distributed-optimizer"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
SUB_GROUP = 700


def _nvme(path: str) -> list[str]:
    return ["--optimizer-offload-device", "nvme", "--offload-nvme-path", path,
            "--offload-sub-group-size", str(SUB_GROUP)]


def _tiers(variant: str, path: str) -> list[str]:
    """The flags of a tier variant: "optimizer", "params" (nvme) or "both"."""
    params = ["--param-offload-device", "nvme", "--offload-nvme-path", path]
    return {"optimizer": _nvme(path), "params": params, "both": _nvme(path) + params[:2]}[variant]


def _curves(prefix: str, root: str, layouts: dict[str, tuple[list[str], tuple[str, ...]]],
            watch: tuple[str, ...] = ()) -> dict:
    """{name: ((losses, grad norms) without offload, {variant: those with its tiers}, files
    left in the nvme directory once every rank's train() returned)}; the runs of the
    variants in `watch` record the parameter tier's resident bytes (`_watch_resident`),
    under "resident": {variant: {"forward": [...], "step": [...]}}."""
    out, resident = {}, {}
    for name, (flags, variants) in layouts.items():
        nvme = os.path.join(root, f"nvme-{name}")
        os.makedirs(nvme, exist_ok=True)
        curve = lambda tier, *extra: train_with_grad_norms(  # noqa: E731
            tiny_args(prefix, os.path.join(root, f"{name}-{tier}"), 3, *EXACT, *flags, *extra))
        plain, tiered = curve("none"), {}
        for variant in variants:
            record = {"forward": [], "step": []}
            with _watch_resident(record, variant in watch):
                tiered[variant] = curve(variant, *_tiers(variant, nvme))
            if variant in watch:
                resident[variant] = record
        dist.barrier()  # every rank's tiers are closed
        out[name] = (plain, tiered, os.listdir(nvme))
    return {**out, "resident": resident} if watch else out


@contextlib.contextmanager
def _watch_resident(record: dict, on: bool):
    """While on: once the chunks' parameter tiers are attached, the live storage bytes of
    every sharded parameter of the chunk appended to record["forward"] at each transformer
    layer's forward and to record["step"] at each sub-group the optimizer's nvme tier steps."""
    from megalite.distributed import fsdp
    from megalite.models.transformer import ParallelTransformerLayer
    from megalite.optimizer.nvme_tier import NvmeTier
    attach, step_group, params = fsdp.attach_param_tier, NvmeTier._step_group, []
    live = lambda: sum(p._local_tensor.untyped_storage().nbytes() for p in params)  # noqa

    def attach_and_watch(root, units, where, path):
        tier = attach(root, units, where, path)
        params.extend(p.sharded_param for unit in tier.units for p in unit.group.fsdp_params)
        for layer in root.modules():
            if isinstance(layer, ParallelTransformerLayer):
                layer.register_forward_pre_hook(lambda *_: record["forward"].append(live()))
        return tier

    def watched_step_group(*args, **kwargs):
        record["step"].append(live())
        return step_group(*args, **kwargs)
    if on:
        fsdp.attach_param_tier, NvmeTier._step_group = attach_and_watch, watched_step_group
    try:
        yield
    finally:
        fsdp.attach_param_tier, NvmeTier._step_group = attach, step_group


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


def _check_parity(results: dict) -> None:
    for name, (plain, tiered, left) in results.items():
        assert len(set(plain[0].values())) == 3, name  # every step moves the weights
        for variant, curves in tiered.items():  # equal: the same fp32 arithmetic
            assert curves == plain, (name, variant)
        assert left == [], f"{name}: the tiers' scratch directories were not removed"


def test_nvme_tier_curves_and_resume_at_dp2(data, tmp_path):
    """One 2-rank task: parity at ZeRO-1, ZeRO-3 (each tier) and bf16 ZeRO-1, the parameter
    tier's device-resident bytes; then the resume chain."""
    layouts = {"zero1": (ZERO1, ("optimizer",)),
               "zero3": (ZERO3, ("optimizer", "params", "both")),
               "bf16 zero1": (ZERO1 + ["--bf16"], ("optimizer",))}
    results = run_on_ranks(2, _curves, data, str(tmp_path), layouts, ("params", "both"))
    resident = [r.pop("resident") for r in results]
    _check_parity(results[0])
    hidden, layers, microbatches = 32, 4, 2  # tiny_args: global batch 8 = 2 x micro 2 x DP2
    layer = (12 * hidden ** 2 + 13 * hidden) * 4 // 2  # a layer's fp32 shard over DP2
    root = ((128 + 16) * hidden + 2 * hidden) * 4 // 2  # tied embedding (vocab padded to 128),
    for watched in resident:  # positions, final norm
        for variant, record in watched.items():
            forward = record["forward"][layers * microbatches:]  # the first step starts resident
            assert len(forward) == 2 * layers * microbatches
            print(f"{variant}: resident sharded parameter bytes at the layers' forwards "
                  f"{max(forward)}, bound {2 * layer}; at the step's sub-groups "
                  f"{max(record['step'], default=None)}, bound {2 * layer + root}, all "
                  f"{layers * layer + root}")
            assert 0 < max(forward) <= 2 * layer, record
        assert 0 < max(watched["both"]["step"]) <= 2 * layer + root, watched
    chain = run_on_ranks(2, _resume_chain, data, str(tmp_path / "chain"))[0]
    want, got = chain
    assert sorted(got) == list(range(1, 7))
    worst = max(abs(got[i] - want[i]) / abs(want[i]) for i in want)
    print(f"resume chain: worst relative loss difference {worst:.2g}")
    assert worst < 1e-5, (got, want)


def _resume_chain(prefix: str, root: str) -> tuple[dict, dict]:
    """(uninterrupted losses, the chain's losses by iteration): see the module docstring."""
    nvme = os.path.join(root, "nvme")
    os.makedirs(nvme, exist_ok=True)
    ck = os.path.join(root, "ck")
    base = lambda save, *flags: tiny_args(prefix, save, 6, *EXACT, *flags)  # noqa: E731
    want = train_with_grad_norms(base(os.path.join(root, "whole"), *ZERO1))[0]
    got = {}
    os.environ["MEGALITE_FAULT"] = "sigterm@2:1"
    try:
        got.update(train_with_grad_norms(base(ck, *ZERO3, *_tiers("both", nvme)))[0])
    finally:
        del os.environ["MEGALITE_FAULT"]
    got.update(train_with_grad_norms(base(ck, *ZERO1, "--tp", "2", "--load", ck,
                                          "--exit-interval", "4"))[0])
    got.update(train_with_grad_norms(base(ck, *ZERO3, *_nvme(nvme), "--param-offload-device",
                                          "cpu", "--load", ck))[0])
    return want, got


def test_nvme_tier_curves_at_tp2_pp2_dp2_zero3(data, tmp_path):
    layouts = {"zero3 tp2 pp2 dp2": (ZERO3 + ["--tp", "2", "--pp", "2"], ("both",))}
    _check_parity(run_on_ranks(8, _curves, data, str(tmp_path), layouts)[0])


def _start_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_bad_nvme_paths_are_one_line_before_training(data, tmp_path, capsys, monkeypatch):
    argv = lambda path: tiny_args(data, str(tmp_path / "ck"), 2, *ZERO1, *_nvme(path))  # noqa
    missing = str(tmp_path / "no-disk")
    assert _start_error(capsys, argv(missing)) == \
        (f"error: --offload-nvme-path {missing}: no such directory (the nvme tier's scratch "
         f"files go there: give an existing directory on a local disk)")
    monkeypatch.setattr("megalite.training.checks.free_bytes", lambda path: 0)
    line = _start_error(capsys, argv(str(tmp_path)))
    assert line.startswith(f"error: --offload-nvme-path {tmp_path}: the nvme tier needs ")
    assert line.endswith("MiB for 1 rank(s) of this node, 0.0 MiB are free")

    disk = tmp_path / "disk"
    disk.mkdir()
    temporary_file = tempfile.TemporaryFile

    def refuse(dir):
        if dir == str(disk):
            raise PermissionError(13, "Permission denied")
        return temporary_file(dir=dir)
    monkeypatch.setattr("megalite.training.checks.tempfile.TemporaryFile", refuse)
    assert _start_error(capsys, argv(str(disk))) == \
        f"error: --offload-nvme-path {disk}: {disk} is not writable (Permission denied)"
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("dtype,strategy", [("bf16", "optim"), ("fp32", "optim"),
                                            ("fp32", "optim_grads_params")])
def test_tier_file_holds_the_planners_bytes_in_sub_groups(tmp_path, dtype, strategy):
    """The file of a tier over a 2-D and a 1-D parameter holds the planner's nvme bytes per
    parameter (bf16: master + m, v = 12; fp32 and FSDP2, whose params are the masters: 8), its
    sub-groups cover every element once, none over the sub-group size; the directory goes with
    the tier."""
    import gc

    import torch

    from megalite.optimizer.nvme_tier import NvmeTier
    from megalite.optimizer.optimizer import Fragment
    from megalite.planning.state_bytes import state_bytes_per_param
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    params = [torch.nn.Parameter(torch.randn(37, 29, dtype=torch_dtype)),
              torch.nn.Parameter(torch.randn(50, dtype=torch_dtype))]
    fragments = [Fragment.of(p, p.detach().view(-1), torch.zeros(p.numel()), in_place=True)
                 if strategy == "optim" else Fragment(p, p.detach(), torch.zeros(p.numel()), None)
                 for p in params]
    tier = NvmeTier(fragments, ("exp_avg", "exp_avg_sq"), str(tmp_path), 400)
    numel = sum(p.numel() for p in params)
    assert tier.file_bytes == state_bytes_per_param(dtype, strategy, 1, nvme=True).nvme * numel
    covered = [set() for _ in params]
    for group in tier.groups:
        assert sum(p.hi - p.lo for p in group.pieces) <= 400
        for p in group.pieces:
            assert not covered[p.index] & set(range(p.lo, p.hi))
            covered[p.index] |= set(range(p.lo, p.hi))
    assert [len(c) for c in covered] == [p.numel() for p in params]
    assert len(os.listdir(tmp_path)) == 1
    del tier, fragments
    gc.collect()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fields,line", [
    ({"optimizer_offload_device": "nvme"},
     "--optimizer-offload-device nvme and --offload-nvme-path DIR go together"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_device": "nvme",
      "offload_nvme_path": "/tmp"},
     "--optimizer-cpu-offload is --optimizer-offload-device cpu: it cannot go with"),
    ({"param_offload_device": "nvme"},
     "--param-offload-device nvme needs --offload-nvme-path DIR"),
])
def test_tier_flag_combinations_are_one_line(fields, line):
    from megalite.config import OptimizerConfig
    with pytest.raises(ValueError) as error:
        OptimizerConfig(**fields)
    assert line in str(error.value) and "\n" not in str(error.value)


def test_the_tier_needs_a_sharded_strategy():
    from megalite.config import parse_configs
    from megalite.layout import RunLayout
    configs = parse_configs(["--num-layers", "4", *_nvme("/tmp")])
    with pytest.raises(ValueError) as error:
        RunLayout.from_configs(configs, 2)
    assert str(error.value).startswith(
        "--optimizer-offload-device nvme needs a sharded --data-parallel-sharding-strategy")


@pytest.mark.parametrize("flags,line", [
    (ZERO1, "--param-offload-device nvme moves ZeRO-3's sharded parameters: it needs "
            "--data-parallel-sharding-strategy optim_grads_params (got optim)"),
    (ZERO3 + ["--optimizer-offload-device", "cpu"],
     "--param-offload-device nvme cannot go with the cpu optimizer tier"),
    (ZERO3 + ["--async-save"], "--param-offload-device nvme cannot go with --async-save"),
])
def test_the_param_tier_refuses_with_one_line(flags, line):
    from megalite.config import parse_configs
    from megalite.layout import RunLayout
    configs = parse_configs(["--num-layers", "4", *flags, *_tiers("params", "/tmp")])
    with pytest.raises(ValueError) as error:
        RunLayout.from_configs(configs, 2)
    assert str(error.value).startswith(line) and "\n" not in str(error.value)


def test_the_planner_moves_the_sharded_parameters_to_the_param_tier():
    """ZeRO-3 over 4 ranks in bf16 holds 16/4 B/param (FSDP2's fp32 masters, grads, Adam):
    the parameter tier moves the parameters' 4/4 to host memory or files, off the device;
    with the optimizer's nvme tier too, 12/4 are in files."""
    from megalite.config import OptimizerConfig
    from megalite.planning.state_bytes import state_bytes_per_param
    plain = state_bytes_per_param("bf16", "optim_grads_params", 4)
    assert plain.device == 4
    cpu = state_bytes_per_param("bf16", "optim_grads_params", 4, param_tier="cpu")
    assert (cpu.host, cpu.nvme, cpu.device) == (1, 0, 3)
    nvme = state_bytes_per_param("bf16", "optim_grads_params", 4, param_tier="nvme")
    assert (nvme.host, nvme.nvme, nvme.device) == (0, 1, 3)
    both = state_bytes_per_param("bf16", "optim_grads_params", 4, False,
                                 OptimizerConfig(), True, "nvme")
    assert (both.nvme, both.device) == (3, 1)


RSS_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--vocab-size", "4096", "--seq-length", "16", "--max-position-embeddings", "16",
             "--micro-batch-size", "1", "--use-distributed-optimizer", "--hidden-dropout", "0",
             "--attention-dropout", "0"]  # 4.2M parameters in 4 layers' matrices, 1M embedding
RSS_SLACK = 8 * 2 ** 20  # allocator and per-sub-group transients
RSS_SUB_GROUP = 2 ** 18  # as large as the largest matrix of a layer


def _peak_rss(argv: list[str]) -> dict:
    """In a fresh 1-rank pool: the resident-set high-water mark's rise (VmHWM, reset through
    /proc/self/clear_refs) over building the model and optimizer and two train steps, and
    the tier's file and buffer bytes."""
    import functools

    import torch

    from megalite.config import parse_configs
    from megalite.device import current_device
    from megalite.layout import RunLayout
    from megalite.optimizer import get_optimizer
    from megalite.training.loop import train_step
    from megalite.training.setup import build_model, setup_parallel

    def kib(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field))
    warm = torch.nn.Parameter(torch.zeros(4, device="cpu"))  # torch's one-time optimizer imports
    warm.grad = torch.zeros(4, device="cpu")
    torch.optim.AdamW([warm]).step()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = kib("VmRSS:")
    configs = parse_configs(argv)
    layout = RunLayout.from_configs(configs, 1)
    setup_parallel(configs, layout)
    model = build_model(configs, functools.partial(pretrain_gpt.model_provider, configs))
    optimizer, _ = get_optimizer(configs.optimizer, configs.precision, model, 10)
    tokens = torch.randint(0, configs.model.vocab_size, (1, configs.train.seq_length + 1),
                           generator=torch.Generator().manual_seed(0)).to(current_device())
    for _ in range(2):
        train_step(pretrain_gpt.forward_step, iter([{"tokens": tokens}]), model, optimizer,
                   layout)
    tier = optimizer.tier
    return {"rss": (kib("VmHWM:") - start) * 1024,
            "file": tier.file_bytes if tier else 0,
            "params": sum(f.grad.numel() for f in optimizer.fragments),
            "buffers": sum(b.numel() * b.element_size() for b in tier.buffers) if tier else 0}


def test_nvme_tier_peak_rss_is_below_the_cpu_tiers(tmp_path):
    """Fresh processes, one per tier (fp32, ZeRO-1, 1 rank): the nvme tier's peak RSS is below
    the cpu tier's by at least what the planner says the cpu tier holds on the host (fp32
    master, m, v: 12 bytes per parameter) less the nvme tier's buffers, less RSS_SLACK."""
    from megalite.distributed.rank_pool import run_once
    from megalite.planning.state_bytes import state_bytes_per_param, tier_host_bytes
    fresh = functools.partial(run_once, 1, _peak_rss, start_method="spawn")  # nothing preloaded
    cpu = fresh(RSS_MODEL + ["--optimizer-offload-device", "cpu"])[0]
    nvme = fresh(RSS_MODEL + _nvme(str(tmp_path))[:-1] + [str(RSS_SUB_GROUP)])[0]
    assert nvme["buffers"] == tier_host_bytes(RSS_SUB_GROUP)
    cpu_host = state_bytes_per_param("fp32", "optim", 1, offload=True).host * nvme["params"]
    margin = cpu_host - nvme["buffers"] - RSS_SLACK
    print(f"peak RSS: cpu tier {cpu['rss'] / 2**20:.1f} MiB, nvme {nvme['rss'] / 2**20:.1f} MiB,"
          f" asserted margin {margin / 2**20:.1f} MiB")
    assert cpu["rss"] - nvme["rss"] >= margin, (cpu, nvme, margin)
