"""The iteration directories of a checkpoint root: iter_<N:07d>, the marker naming the newest
complete one, atomic publish (rename + marker) and retention.
"""
import os
import re
import shutil

from megalite.checkpoint.files import fsync_dir

MARKER = "latest_checkpointed_iteration.txt"



def iteration_dir(root: str, iteration: int) -> str:
    """The directory of one saved iteration: <root>/iter_0000042."""
    return os.path.join(root, f"iter_{iteration:07d}")



def published_dir(root: str, iteration: int) -> str:
    """iter_N, or its previous copy if a re-save of N stopped between its two renames."""
    final = iteration_dir(root, iteration)
    return final if os.path.isdir(final) or not os.path.isdir(final + ".old") else final + ".old"



def rank_state_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}")



def write_atomic_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")



def publish(root: str, iteration: int, tmp: str) -> None:
    """Move the complete `tmp` to iter_N (keeping any old iter_N until then) and mark it."""
    final = iteration_dir(root, iteration)
    fsync_dir(tmp)
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    write_atomic_text(os.path.join(root, MARKER), str(iteration))
    shutil.rmtree(old, ignore_errors=True)



def prune_checkpoints(root: str, keep: int, written: int) -> list[int]:
    """Delete every published iteration of `root` but the newest `keep` and `written` (the
    one just saved); return the deleted iterations."""
    saved = sorted(int(name[5:]) for name in os.listdir(root)
                   if re.fullmatch(r"iter_\d{7}", name))
    doomed = [i for i in saved[:-keep] if i != written]
    for i in doomed:
        shutil.rmtree(iteration_dir(root, i))
    return doomed



def latest_iteration(root: str) -> int | None:
    """The iteration named by the marker, or None when `root` holds no checkpoint."""
    path = os.path.join(root, MARKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit() or not os.path.isdir(published_dir(root, int(text))):
        raise ValueError(f"--load {root}: {MARKER} names {text!r}, which is not a complete "
                         f"checkpoint directory")
    return int(text)



def mark_latest(root: str, iteration: int) -> None:
    """Make the saved `iteration` the one `--load` picks (one process; no communication)."""
    if not os.path.isdir(published_dir(root, iteration)):
        raise ValueError(f"{root}: no checkpoint of iteration {iteration}")
    write_atomic_text(os.path.join(root, MARKER), str(iteration))



def describe_start(load: str | None, iteration: int, train_iters: int) -> str:
    """What a run starts from, in words: scratch, a resumed iteration, or one that already
    reached --train-iters."""
    if load is None or latest_iteration(load) is None:
        return f"starting from scratch ({f'no checkpoint in {load} yet' if load else 'no --load'})"
    if iteration >= train_iters:
        return (f"{load} is at iteration {iteration}, --train-iters is {train_iters}: nothing "
                f"left to do (raise --train-iters to train on)")
    return f"resumed from {load} at iteration {iteration}"
