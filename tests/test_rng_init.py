"""Weight initialisation from private CPU generators, and RNG states that move between devices.

A model's weights are drawn on the CPU from a generator seeded per part of the model
(crc32 of "seed:part") and then moved to the model's device, so they equal what an explicit
torch.Generator gives, whatever the global RNG did before, the TP size and the device;
building a model neither reads nor changes the global RNG (no torch.manual_seed: on a GPU
that would reseed every CUDA generator). The TP layers draw the full tensor a block of rows
at a time, which gives exactly the values of one full draw. A checkpoint whose RNG states
come from a run on another device type (CUDA, on CPU) resumes with one printed line.
"""
import contextlib
import io
import math
import zlib

import torch

from megalite.checkpoint.dirs import iteration_dir, rank_state_path
from megalite.checkpoint.files import load_state, save_state
from megalite.config import ModelConfig
from megalite.device import current_device, device_type
from megalite.models import GPTModel
from megalite.models.sharding import full_state_dict
from megalite.mpu import initialize_model_parallel, layers
from megalite.mpu.layers import init_method_normal
from megalite.mpu.random import MODEL_PARALLEL_RNG, seeded
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks

SEED, STD = 1234, 0.02
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97,
                     max_position_embeddings=16, init_method_std=STD)


def _generator(part: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{SEED}:{part}".encode()))


def _expected() -> dict[str, torch.Tensor]:
    """Weights drawn directly from explicit generators, in each part's order of draws."""
    h, v = CONFIG.hidden_size, CONFIG.vocab_size
    layer = _generator("layer.0")
    qkv = torch.empty(3 * h, h).normal_(0, STD, generator=layer)
    dense = torch.empty(h, h).normal_(0, STD / math.sqrt(2 * CONFIG.num_layers), generator=layer)
    position = _generator("embedding.position")
    torch.empty(16, h).normal_(generator=position)  # the draw nn.Embedding's constructor took
    return {"embedding.word_embeddings.weight": torch.empty(v, h).normal_(
                0, STD, generator=_generator("embedding.word")),
            "embedding.position_embeddings.weight": torch.empty(16, h).normal_(
                0, STD, generator=position),
            "encoder.layers.0.self_attention.query_key_value.weight": qkv,
            "encoder.layers.0.self_attention.dense.weight": dense}


def _forbidden(*args, **kwargs):
    raise AssertionError("building a model touched the global RNG")


def _build_twice(tp: int) -> dict:
    """Full weights of two builds with unrelated RNG use before each, and whether the global
    RNG state stayed as it was (torch.manual_seed and friends made to fail meanwhile)."""
    initialize_model_parallel(tp, 1)
    builds, untouched = [], True
    for _ in range(2):
        torch.manual_seed(0)
        torch.rand(5, device="cpu")  # the global CPU generator, whose state is checked
        before = torch.get_rng_state()
        with contextlib.ExitStack() as stack:
            for owner, name in ((torch, "manual_seed"), (torch, "set_rng_state"),
                                (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"),
                                (torch.random, "fork_rng")):
                original = getattr(owner, name)
                setattr(owner, name, _forbidden)
                stack.callback(setattr, owner, name, original)
            model = GPTModel(CONFIG, init_seed=SEED, device=current_device())
        untouched &= torch.equal(before, torch.get_rng_state())
        builds.append(full_state_dict(model))
    return {"builds": builds, "untouched": untouched}


def test_weights_come_from_private_generators_whatever_the_tp_size():
    want = _expected()
    results = run_on_ranks(1, _build_twice, 1) + run_on_ranks(2, _build_twice, 2)
    for result in results:
        assert result["untouched"]
        first, second = result["builds"]
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)
        for name, value in want.items():
            assert torch.equal(first[name], value), name
    assert all(torch.equal(results[0]["builds"][0][k], v)
               for result in results[1:] for k, v in result["builds"][0].items())


def _other_device_states() -> dict:
    """The RNG entries a checkpoint of a run on the other device type holds (CPU <-> CUDA)."""
    if device_type() == "cuda":
        cpu_state = torch.get_rng_state()
        return {"device_type": "cpu", "tracker": {MODEL_PARALLEL_RNG: cpu_state}}
    # a CUDA generator's state (seed and offset), which lives on the host as every RNG state
    cuda_state = torch.zeros(16, dtype=torch.uint8, device="cpu")
    return {"device_type": "cuda", "cuda": cuda_state,
            "tracker": {MODEL_PARALLEL_RNG: cuda_state.clone()}}


def _resume_from_another_device(prefix: str, root: str) -> tuple[str, list[int]]:
    """Train 2 steps, make the saved RNG states those of a run on the other device type,
    resume to step 3: (the resumed run's output, its iterations)."""
    train(tiny_args(prefix, root, 2, "--dp", "2"))
    path = rank_state_path(iteration_dir(root, 2), torch.distributed.get_rank())
    torch.distributed.barrier()
    state = load_state(path)
    state["rng"].pop("cuda", None)
    state["rng"].update(_other_device_states())
    save_state(path, state)
    torch.distributed.barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train(tiny_args(prefix, root, 3, "--dp", "2", "--load", root))
    return out.getvalue(), sorted(losses)


def test_checkpoint_rng_from_another_device_type_resumes_with_one_line(tmp_path):
    """On CPU: a checkpoint of a CUDA run (CUDA-sized generator states) resumes."""
    prefix = make_dataset(str(tmp_path))
    results = run_on_ranks(2, _resume_from_another_device, prefix, str(tmp_path / "ck"))
    here = device_type()
    other = "cpu" if here == "cuda" else "cuda"
    lines = [line for log, _ in results for line in log.splitlines() if "RNG states" in line]
    assert lines == [f"checkpoint RNG states are from a {other} run, this run is on {here}: "
                     f"torch's RNG streams start from --seed"], [log for log, _ in results]
    assert all(iterations == [3] for _, iterations in results)


def test_tp_init_in_blocks_of_rows_gives_the_values_of_one_full_draw(monkeypatch):
    """Every rank's shard, drawn a few rows at a time (no full tensor held), is its slice of
    one normal draw over the whole tensor, for row and column splits, SwiGLU's strided
    [gate; up], GQA replicas and vocabulary padding rows (zero)."""
    monkeypatch.setattr(layers, "_INIT_BLOCK_ELEMENTS", 48)  # blocks of 16 rows here
    cases = [((96, 32), 0, 4, 1, 1, None), ((32, 96), 1, 4, 1, 1, None),
             ((64, 7), 0, 2, 2, 1, None), ((40, 3), 0, 4, 1, 2, None),
             ((256, 5), 0, 2, 1, 1, 97), ((100, 1), 0, 1, 1, 1, None),
             ((61, 3), 1, 1, 1, 1, None), ((3, 5), 0, 1, 1, 1, None)]
    for shape, dim, size, stride, replicas, init_rows in cases:
        full = torch.zeros(shape)
        rows = shape[0] if init_rows is None else init_rows
        full[:rows].normal_(0, STD, generator=torch.Generator().manual_seed(9))
        want = layers._split_shards(full, dim, stride, size // replicas)
        for rank in range(size):
            with seeded(9):
                got = layers._sharded_parameter(shape, dim, size, rank, init_method_normal(STD),
                                                torch.float32, None, stride, replicas, init_rows)
            assert torch.equal(got.detach(), want[rank // replicas]), (shape, dim, rank)
