"""Start-up checks of what a run will write, before any process group and before any work.

Every rank checks its own filesystem, so a `--save` on a node-local disk is checked on each
node. A problem is one ValueError naming the flag.
"""
import os
import shutil
import tempfile

from megalite import checkpoint
from megalite.config import Configs
from megalite.data.gpt_dataset import check_data, check_split
from megalite.layout import RunLayout
from megalite.models.layer_drop import check_layer_drop
from megalite.planning.planner import run_plan
from megalite.training.log_writers import check_available
from megalite.training.resilience import parse_faults


def check_writable_dir(flag: str, path: str) -> None:
    """ValueError unless `path` is a directory this process can write into, or can be created
    as one (its nearest existing ancestor is a writable directory). Creates nothing."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is" if existing == os.path.abspath(path) else f"is inside {existing}, which is"
        raise ValueError(f"{flag} {path}: {what} not a directory")
    try:  # os.access is blind to read-only mounts, and to permissions when run as root
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {existing} is not writable ({error.strerror})") \
            from None


class StartError(Exception):
    """A run that cannot start (a bad flag, file or data): one line, the same on every rank.
    The runner (megalite.tasks.runner) ends the process with it."""


def check_start(configs: Configs, task_outputs: dict[str, str | None]) -> None:
    """Every output directory the flags name (the task's `task_outputs` {flag: path}
    included) is writable, and --split leaves training documents when there are steps to
    train (the data itself, even the built-in corpus, need not exist yet)."""
    t = configs.train
    outputs = {"--save": configs.checkpoint.save, "--tensorboard-dir": t.tensorboard_dir,
               "--data-cache-dir": configs.data.data_cache_dir, **task_outputs}
    for flag, path in outputs.items():
        if path:
            check_writable_dir(flag, path)
    check_split(configs.data.split, needs_train=t.train_iters > 0)


def check_before_start(configs: Configs, layout: RunLayout) -> None:
    """Checks that need files but no process group: --save/--load directories, the load's
    metadata and files (every rank sees the same files, so every rank reports the same
    line), the optional log sinks and the fault-injection hook. Raises ValueError."""
    ckpt, m, t = configs.checkpoint, configs.model, configs.train
    if configs.data.data_path:  # missing, truncated, empty or out-of-vocabulary data
        check_data(configs.data.data_path, configs.data.split, m.vocab_size,
                   needs_train=t.train_iters > 0)
    check_available(t.tensorboard_dir, t.wandb_project)
    check_layer_drop(configs)
    if configs.optimizer.offload_nvme_path:  # an nvme tier (optimizer or parameters)
        check_nvme_path(configs, layout)
    parse_faults(os.environ.get("MEGALITE_FAULT", ""))
    start = 0
    if ckpt.load and (meta := checkpoint.read_meta(ckpt.load)):
        checkpoint.check_compatible(meta, m, ckpt.load,
                                       configs.precision.params_dtype)
        checkpoint.verify(ckpt.load, meta, layout.grid.as_dict(), layout.world_size)
        start = meta["iteration"]
    saved = checkpoint.latest_iteration(ckpt.save) if ckpt.save else None
    same = ckpt.load and ckpt.save and os.path.realpath(ckpt.load) == os.path.realpath(ckpt.save)
    if saved is not None and saved > start and not same:
        raise ValueError(f"--save {ckpt.save} already holds iteration {saved}, newer than this "
                         f"run's start ({start}): pass --load {ckpt.save} to resume it, or "
                         f"another --save directory")


def free_bytes(path: str) -> int:
    """Bytes free for this user on the filesystem of `path`."""
    return shutil.disk_usage(path).free


def check_nvme_path(configs: Configs, layout: RunLayout) -> None:
    """--offload-nvme-path is an existing writable directory whose filesystem has room for the
    nvme tier's files of every rank of this node (LOCAL_WORLD_SIZE, torchrun's; else the
    world): the planner's bytes per rank (megalite.planning.planner.Plan.tier_bytes)."""
    path, flag = configs.optimizer.offload_nvme_path, "--offload-nvme-path"
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: no such directory (the nvme tier's scratch files go "
                         f"there: give an existing directory on a local disk)")
    check_writable_dir(flag, path)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    need, free = run_plan(configs, layout).tier_bytes()[0] * ranks, free_bytes(path)
    if need > free:
        raise ValueError(f"{flag} {path}: the nvme tier needs {need / 2 ** 20:,.1f} MiB for "
                         f"{ranks} rank(s) of this node, {free / 2 ** 20:,.1f} MiB are free")
