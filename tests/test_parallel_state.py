"""Process groups on 8 ranks match the tp-dp-pp layout of DESIGN.md; bad sizes fail first;
re-initialising a layout frees the previous groups."""
import weakref

import pytest
import torch
import torch.distributed as dist

from megalite.device import current_device
from megalite.distributed import DistributedDataParallel
from megalite.mpu import parallel_state as ps
from tests.helpers.multirank import run_on_ranks, thread_count

LAYOUTS = [(2, 2, 2), (2, 4, 1), (4, 1, 2), (8, 1, 1), (1, 8, 1)]


def expected_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Independent construction from rank = tp_rank + TP * (dp_rank + DP * pp_rank)."""
    coords = {r: (r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(tp * pp * dp)}

    def groups(axis: int) -> list[list[int]]:
        keyed: dict[tuple, list[int]] = {}
        for rank, c in coords.items():
            keyed.setdefault(tuple(v for i, v in enumerate(c) if i != axis), []).append(rank)
        return sorted(keyed.values())
    pp_groups = groups(2)
    return {"tp": groups(0), "dp": groups(1), "pp": pp_groups,
            "embedding": sorted(sorted({g[0], g[-1]}) for g in pp_groups)}


def _my_groups(tp: int, pp: int) -> dict:
    ps.initialize_model_parallel(tp, pp)
    rank = dist.get_rank()
    info = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "pp": ps.get_pipeline_model_parallel_ranks(), "embedding": ps.get_embedding_ranks(),
        "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "first": ps.is_pipeline_first_stage(), "last": ps.is_pipeline_last_stage(),
        "sizes": (ps.get_tensor_model_parallel_world_size(),
                  ps.get_pipeline_model_parallel_world_size(),
                  ps.get_data_parallel_world_size()),
    }
    # The groups really are usable: an all-reduce of the global rank over TP sums the TP ranks.
    t = torch.tensor([float(rank)], device=current_device())
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    info["tp_sum"] = t.item()
    return info


def _all_layouts() -> list:
    return [_my_groups(tp, pp) for tp, pp, _ in LAYOUTS]


def test_groups_match_design_layout():
    per_rank = run_on_ranks(8, _all_layouts)
    for i, (tp, pp, dp) in enumerate(LAYOUTS):
        want = expected_groups(tp, pp, dp)
        for rank, infos in enumerate(per_rank):
            got = infos[i]
            for kind in ("tp", "dp", "pp", "embedding"):
                mine = [g for g in want[kind] if rank in g]
                assert got[kind] == (mine[0] if mine else []), (tp, pp, dp, rank, kind)
            assert (got["tp_rank"], got["dp_rank"], got["pp_rank"]) == \
                (rank % tp, (rank // tp) % dp, rank // (tp * dp))
            assert got["first"] == (got["pp_rank"] == 0)
            assert got["last"] == (got["pp_rank"] == pp - 1)
            assert got["sizes"] == (tp, pp, dp)
            assert got["tp_sum"] == sum(got["tp"])


def test_design_example_layout():
    """The 8-rank TP=2, PP=2, DP=2 example written out in DESIGN.md."""
    want = expected_groups(2, 2, 2)
    assert want["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert want["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert want["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world,tp,pp,vpp,flag", [
    (8, 3, 1, None, "world size 8 is not divisible"),
    (8, 2, 3, None, "not divisible"),
    (8, 0, 1, None, "must be >= 1"),
    (8, 2, 1, 2, "--virtual-pipeline-model-parallel-size"),
    (8, 1, 2, 0, "--virtual-pipeline-model-parallel-size"),
])
def test_invalid_sizes_fail_with_one_line(world, tp, pp, vpp, flag):
    with pytest.raises(ValueError, match=flag) as err:
        ps.GridLayout.from_world(world, tp, pp, vpp=vpp)
    assert "\n" not in str(err.value)


def _invalid_then_valid() -> str:
    try:
        ps.initialize_model_parallel(3, 1)
    except ValueError as e:
        message = str(e)
    # No rank entered a collective: the grid still initialises normally afterwards.
    ps.initialize_model_parallel(2, 2)
    dist.barrier()
    return message


def test_invalid_sizes_fail_before_any_collective():
    messages = run_on_ranks(8, _invalid_then_valid)
    assert all("not divisible" in m for m in messages)


def _ddp_step(tp: int, pp: int) -> weakref.ref:
    """Initialise (tp, pp) over whatever layout is there, train a DDP-wrapped layer once and
    drop it; a weak reference to the wrapper."""
    ps.initialize_model_parallel(tp, pp)
    model = DistributedDataParallel(torch.nn.Linear(4, 4, device=current_device()))
    model(torch.ones(2, 4, device=current_device())).sum().backward()
    model.finish_grad_sync()
    return weakref.ref(model)


def _re_initialised_layouts_leave_nothing_behind() -> tuple[int, int, bool]:
    """After one warm-up step: three layouts initialised one over the other (no destroy in
    between), each training a DDP-wrapped layer, then destroy. (OS threads before, after,
    whether a wrapper is still alive.)"""
    _ddp_step(2, 2)
    ps.destroy_model_parallel()
    before = thread_count()
    wrappers = [_ddp_step(tp, pp) for tp, pp in ((2, 1), (1, 2), (2, 2))]
    ps.destroy_model_parallel()
    dist.barrier()
    return before, thread_count(), any(w() is not None for w in wrappers)


def test_re_initialising_destroys_the_previous_groups_and_ddp_frees_its_model():
    for before, after, alive in run_on_ranks(4, _re_initialised_layouts_leave_nothing_behind):
        # every group left alive keeps gloo threads in the process (3 each); the wrappers'
        # grad hooks must not keep them (nor their models' groups) alive
        assert after == before and not alive, (before, after, alive)
