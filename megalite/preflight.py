"""Start-up checks of what a run will write, before any process group and before any work.

Every rank checks its own filesystem, so a `--save` on a node-local disk is checked on each
node. A problem is one ValueError naming the flag.
"""
import os
import tempfile

from megalite.config import Configs
from megalite.data.gpt_dataset import check_split


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


def check_start(configs: Configs) -> None:
    """Every output directory the flags name is writable, and --split leaves training
    documents when there are steps to train (the data itself, even the built-in corpus,
    need not exist yet)."""
    t, ft = configs.train, configs.finetune
    outputs = {"--save": configs.checkpoint.save, "--tensorboard-dir": t.tensorboard_dir,
               "--data-cache-dir": configs.data.data_cache_dir,
               "--export-dir": ft.export_dir if ft else None}
    for flag, path in outputs.items():
        if path:
            check_writable_dir(flag, path)
    check_split(configs.data.split, needs_train=t.train_iters > 0)
