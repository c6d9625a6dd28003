"""Streamed checkpoint files: a save adds no more host memory than the writer's bounded buffer
(peak RSS of a fresh rank, against the previous writer: host copies + safetensors'
save_file), the files are byte for byte that writer's, a load reads only the slices it
needs, and an asynchronous save on the CPU writes the state of its iteration although the
next optimizer step follows at once."""
import os
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalite import checkpoint
from megalite.checkpoint import files
from megalite.device import current_device
from megalite.distributed.rank_pool import run_once
from tests.helpers.multirank import run_on_ranks

MIB = 2 ** 20
BUFFER = MIB  # the bounded buffer in these tests (64 MiB in training)
MARGIN = 8 * MIB  # the header, Python objects, the allocator's slack; a process's first save
# also faults in library code and kernels (~4 MiB), whatever the state's size


def _peak() -> int:
    """This process's peak resident set (bytes): VmHWM, the high-water mark of its own memory.
    (getrusage's ru_maxrss would do, but a spawned process inherits its parent's peak through
    exec, and pytest's can be larger than this whole test's.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _rise(fn) -> int:
    """How far `fn()` raises this process's peak resident set (bytes)."""
    before = _peak()
    fn()
    return _peak() - before


def _trained(hidden: int = 256):
    """A 4-layer GPT (fp32, one rank; ~40 MiB of weights and Adam moments) after one Adam
    step on random grads: (configs, model, optimizer, scheduler)."""
    from megalite.config import parse_configs
    from megalite.layout import RunLayout
    from megalite.models import GPTModel
    from megalite.optimizer import get_optimizer
    from megalite.training.setup import build_model, setup_parallel
    configs = parse_configs(["--num-layers", "4", "--hidden-size", str(hidden),
                             "--num-attention-heads", "4", "--seq-length", "8",
                             "--max-position-embeddings", "8", "--vocab-size", "97",
                             "--micro-batch-size", "1", "--global-batch-size", "1",
                             "--train-iters", "10"])
    setup_parallel(configs, RunLayout.from_configs(configs, 1))
    model = build_model(configs, lambda pre_process, post_process: GPTModel(
        configs.model, pre_process=pre_process, post_process=post_process,
        device=current_device()))
    optimizer, scheduler = get_optimizer(configs.optimizer, configs.precision, model, 10)
    _random_step(model, optimizer)
    return configs, model, optimizer, scheduler


def _random_step(model, optimizer) -> None:
    for param in model[0].parameters():
        param.main_grad.normal_(std=1e-3)
    optimizer.step()


def _shard(model, optimizer) -> dict[str, torch.Tensor]:
    """The slices a save of this rank writes (views of the live tensors)."""
    from megalite.checkpoint.shards import ShardWriter
    from megalite.checkpoint.state import collect_shards
    writer = ShardWriter(0)
    collect_shards(model, optimizer, writer)
    return writer.tensors


def _streamed_rises(root: str) -> dict[str, int]:
    """In a fresh rank: the peak-RSS rise of a first and a second save, of a write of 2-D
    views transposed (every byte through the bounded buffer), and of reading one row of a
    shard."""
    from megalite.checkpoint.loading import checkpoint_reader
    files.STREAM_BUFFER_BYTES = BUFFER
    configs, model, optimizer, scheduler = _trained()
    state = _shard(model, optimizer)
    rises = {"state": sum(t.numel() * t.element_size() for t in state.values())}
    for iteration, name in ((1, "first save"), (2, "save")):
        rises[name] = _rise(lambda: checkpoint.save(root, iteration, model, optimizer,
                                                    scheduler, 0, configs.model))
    views = {k: v.t() for k, v in state.items() if v.ndim == 2}
    rises["views"] = sum(v.numel() * v.element_size() for v in views.values())
    rises["write views"] = _rise(lambda: files.write_tensors(f"{root}/views", views))
    reader = checkpoint_reader(root, checkpoint.read_meta(root))
    name = "embedding.word_embeddings.weight"
    row = torch.empty(1, reader.entry("model", name)["shape"][1], device="cpu")
    rises["read row"] = _rise(lambda: reader.read_into("model", name, ((5, 0), tuple(row.shape)),
                                                       row))
    rises["row ok"] = torch.equal(row[0], state[next(k for k in state if name in k
                                                      and k.startswith("model/"))][5])
    return rises


def _reference_rise(root: str) -> int:
    """In a fresh rank, after a first save as above, the peak-RSS rise of the previous
    writer: host copies of the slices, then safetensors' save_file."""
    configs, model, optimizer, scheduler = _trained()
    checkpoint.save(root, 1, model, optimizer, scheduler, 0, configs.model)
    return _rise(lambda: save_file(
        {k: v.to("cpu", copy=True).contiguous() for k, v in _shard(model, optimizer).items()},
        f"{root}/reference.safetensors"))


def test_a_save_adds_at_most_the_bounded_buffer_where_copies_added_the_state(tmp_path):
    new = run_once(1, _streamed_rises, str(tmp_path / "new"), start_method="spawn")[0]
    old = run_once(1, _reference_rise, str(tmp_path / "old"), start_method="spawn")[0]
    assert new["state"] > 30 * BUFFER and new["views"] > 10 * BUFFER
    assert new["first save"] <= BUFFER + MARGIN, new
    assert new["save"] <= BUFFER + MARGIN, new
    assert new["write views"] <= BUFFER + MARGIN, new
    assert old >= 0.8 * new["state"], old  # the previous writer: about the state on top
    assert new["read row"] <= MARGIN and new["row ok"], new  # not the 0.25 MiB embedding
    # the same seeds, the same state: the streamed shard is the reference writer's file
    shard = os.path.join(checkpoint.iteration_dir(str(tmp_path / "new"), 2),
                         "shard_00000.safetensors")
    assert open(shard, "rb").read() == (tmp_path / "old" / "reference.safetensors").read_bytes()


def test_files_are_byte_for_byte_safetensors_own(tmp_path):
    """Views, transposes, bf16, scalars, empty tensors, every dtype megalite stores, metadata;
    through a 64-byte buffer (rows split into pieces) and in place."""
    torch.manual_seed(0)
    base = torch.randn(40, 30)
    tensors = {"view": base[3:7], "transposed": base.t()[2:5], "bf16": torch.randn(5, 7).bfloat16(),
               "bf16 transposed": torch.randn(6, 9).bfloat16().t(), "scalar": torch.tensor(3.5),
               "int64": torch.arange(17), "empty": torch.empty(0, 4), "bool": torch.rand(9) > .5,
               "uint8": torch.randint(0, 255, (13,), dtype=torch.uint8),
               "fp16 strided": torch.randn(3, 3, 3).half()[:, 1], "fp64": torch.randn(5).double(),
               "wide": torch.randn(50, 3).t(), "ünicode": torch.ones(2),
               "int32 every other": torch.arange(9, dtype=torch.int32)[::2]}
    buffer, files.STREAM_BUFFER_BYTES = files.STREAM_BUFFER_BYTES, 64
    try:
        for metadata in (None, {"format": "pt"}):
            files.write_tensors(str(tmp_path / "streamed"), tensors, metadata)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "reference"),
                      metadata)
            assert (tmp_path / "streamed").read_bytes() == (tmp_path / "reference").read_bytes()
    finally:
        files.STREAM_BUFFER_BYTES = buffer
    with safe_open(str(tmp_path / "streamed"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
        assert torch.equal(f.get_slice("wide")[1:2, 10:20], tensors["wide"][1:2, 10:20])


def _async_saves_the_state_of_its_iteration(root: str) -> bool:
    """An async save whose writer starts late (0.5 s): the next optimizer step waits for it,
    so the checkpoint holds the weights of the saved iteration, not the next one's."""
    from megalite.checkpoint.shards import ShardWriter
    write = ShardWriter.write

    def late_write(self, directory: str) -> None:
        time.sleep(0.5)
        write(self, directory)
    configs, model, optimizer, scheduler = _trained(hidden=32)
    saved = {k: v.clone() for k, v in _shard(model, optimizer).items() if k.startswith("model/")}
    ShardWriter.write = late_write
    try:
        pending = checkpoint.save(root, 1, model, optimizer, scheduler, 0, configs.model,
                                  async_save=True)
        _random_step(model, optimizer)
        pending.finish(torch.device("cpu"))
    finally:
        ShardWriter.write = write
    on_disk = checkpoint.read_full_model(root)[1]
    stepped = _shard(model, optimizer)
    return all(torch.equal(on_disk[k.split("/")[1]], v) and not torch.equal(stepped[k], v)
               for k, v in saved.items())


def test_async_save_on_the_cpu_writes_its_iteration_while_the_next_step_waits(tmp_path):
    assert run_on_ranks(1, _async_saves_the_state_of_its_iteration, str(tmp_path / "ck"))[0]


def test_the_plan_counts_what_a_save_adds_to_host_memory():
    """A rank's shard is 12 B/param (fp32 weights + 2 Adam moments), 14 with bf16 masters; a
    save adds the bounded buffer, an async one on GPUs the shard's GPU share too: all of it,
    or the 2-byte weights with the masters and moments offloaded to the host."""
    from megalite.planning.planner import plan
    from tools.plan import parse
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1"]
    for extra, per_param, staged in (([], 12, 12), (["--bf16", "--optimizer-cpu-offload",
                                                    "--use-distributed-optimizer"], 14, 2)):
        p = plan(parse(flags + extra)[0])
        shard = per_param * p.total_params
        assert p.checkpoint_bytes("first") == shard
        assert p.save_host_bytes(False) == min(files.STREAM_BUFFER_BYTES, shard)
        assert p.save_host_bytes(True) == min(files.STREAM_BUFFER_BYTES, shard) + staged * (
            p.total_params)
