"""megalite under PyTorch Lightning (megalite.lightning): Trainer.fit with MegaliteStrategy
trains exactly what the entry scripts train, in the rank pools' existing worlds.

- GPT at TP2 x PP2 x DP2 (strategy keywords; the reference passes --tp/--pp/--dp to
  pretrain_gpt): per-step loss and grad norm within 1e-6 of pretrain_gpt's with the same
  flags and data; the checkpoint ModelCheckpoint wrote after step 2 loads with pretrain_gpt
  --load at TP2 x DP4 and steps 3-4 continue the uninterrupted curve (1e-5: another layout
  sums in another order, as in test_checkpoint_reshard; dropout off, as the RNG streams of
  one layout do not exist in another);
- GPT at DP2 with ZeRO-3 (sharding="optim_grads_params"): the curve of pretrain_gpt's
  --data-parallel-sharding-strategy optim_grads_params, dropout on;
- BERT sentence-pair classification at TP2 x DP2: the loss curve, the accuracy before
  and after each epoch and the best epoch of finetune_bert's run.
"""
import os

import pytorch_lightning as pl

from megalite.mpu import parallel_state as ps
from tests.helpers.gpt_run import make_dataset, tiny_args, train_with_grad_norms
from tests.helpers.multirank import run_on_ranks
from tests.test_finetune_run import task_args, tiny_model_dir, write_task

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]


def _fit(module, strategy, root: str, max_steps: int = -1, **trainer_kwargs):
    """Trainer.fit of `module`; its run (losses, grad norms)."""
    trainer = pl.Trainer(strategy=strategy, max_steps=max_steps, num_sanity_val_steps=0,
                         enable_model_summary=False, enable_progress_bar=False,
                         logger=pl.loggers.CSVLogger(root), default_root_dir=root,
                         log_every_n_steps=1,
                         **trainer_kwargs)
    trainer.fit(module)
    return module.run


def _gpt_curves(prefix: str, root: str) -> dict:
    """8 ranks: pretrain_gpt for 4 steps; Lightning for 2 with a ModelCheckpoint; pretrain_gpt
    --load of that checkpoint at TP2 x DP4 for steps 3-4."""
    from megalite.lightning import MegaliteStrategy
    from megalite.tasks.lightning import GPTModule
    layout = ["--tp", "2", "--pp", "2", "--dp", "2"]
    reference = train_with_grad_norms(tiny_args(prefix, f"{root}/ref", 4, *NO_DROPOUT,
                                                *layout))
    ps.destroy_model_parallel()
    saves = f"{root}/lightning_ckpt"
    run = _fit(GPTModule(tiny_args(prefix, f"{root}/unused", 4, *NO_DROPOUT)),
               MegaliteStrategy(tp=2, pp=2), f"{root}/logs", max_steps=2,
               callbacks=[pl.callbacks.ModelCheckpoint(dirpath=saves, every_n_train_steps=2,
                                                       save_top_k=-1),
                          pl.callbacks.LearningRateMonitor()])
    lightning = run.losses, run.grad_norms
    ps.destroy_model_parallel()
    checkpoint = os.path.join(saves, "epoch=0-step=2.ckpt")
    continued = train_with_grad_norms(tiny_args(prefix, f"{root}/continued", 4, *NO_DROPOUT,
                                                "--load", checkpoint, "--tp", "2", "--dp", "4"))
    return {"reference": reference, "lightning": lightning, "continued": continued}


def _zero3_curves(prefix: str, root: str) -> dict:
    from megalite.lightning import MegaliteStrategy
    from megalite.tasks.lightning import GPTModule
    reference = train_with_grad_norms(tiny_args(prefix, f"{root}/ref3", 2, *ZERO3))
    ps.destroy_model_parallel()
    run = _fit(GPTModule(tiny_args(prefix, f"{root}/unused3", 2)),
               MegaliteStrategy(sharding="optim_grads_params"), f"{root}/logs3")
    return {"reference": reference, "lightning": (run.losses, run.grad_norms)}


def _assert_same(got: dict, want: dict, tolerance: float) -> None:
    assert got.keys() <= want.keys() and got, (got, want)
    for i in got:
        assert abs(got[i] - want[i]) <= tolerance * abs(want[i]), (i, got, want)


def test_gpt_under_lightning_follows_pretrain_gpt_and_its_checkpoint_continues(tmp_path):
    prefix = make_dataset(str(tmp_path))
    curves = run_on_ranks(8, _gpt_curves, prefix, str(tmp_path))[0]
    (ref_loss, ref_norm), (loss, norm) = curves["reference"], curves["lightning"]
    assert sorted(loss) == [1, 2]
    _assert_same(loss, ref_loss, 1e-6)
    _assert_same(norm, ref_norm, 1e-6)
    cont_loss, cont_norm = curves["continued"]
    assert sorted(cont_loss) == [3, 4]
    _assert_same(cont_loss, ref_loss, 1e-5)
    _assert_same(cont_norm, ref_norm, 1e-5)
    metrics = open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read()
    header = metrics.splitlines()[0].split(",")
    assert {"loss", "grad_norm", "lr", "lr-AdamW/pg1"} <= set(header), metrics


def test_gpt_under_lightning_with_zero3_follows_pretrain_gpt(tmp_path):
    prefix = make_dataset(str(tmp_path))
    curves = run_on_ranks(2, _zero3_curves, prefix, str(tmp_path))[0]
    (ref_loss, ref_norm), (loss, norm) = curves["reference"], curves["lightning"]
    assert sorted(loss) == [1, 2]  # the run ends at --train-iters without max_steps
    _assert_same(loss, ref_loss, 1e-6)
    _assert_same(norm, ref_norm, 1e-6)


def _bert_runs(task_dir: str, root: str) -> dict:
    from megalite.lightning import MegaliteStrategy
    from megalite.tasks.lightning import BertClassificationModule
    from megalite.tasks import bert
    flags = task_args(task_dir, "--epochs", "2")
    reference = bert.run([*flags, "--tp", "2", "--save", f"{root}/bert_ref", "--export-dir",
                          f"{root}/bert_ref_hf"])
    ps.destroy_model_parallel()
    module = BertClassificationModule([*flags, "--export-dir", f"{root}/bert_hf"])
    run = _fit(module, MegaliteStrategy(tp=2), f"{root}/bert_logs")
    return {"reference": (reference.losses, reference.counts, reference.best_epoch),
            "lightning": (run.losses, module.task.counts, module.task.best_epoch)}


def test_bert_pair_classification_under_lightning_follows_finetune_bert(tmp_path):
    task_dir = str(tmp_path)
    tiny_model_dir(os.path.join(task_dir, "model"))
    write_task(os.path.join(task_dir, "train.jsonl"), 32, seed=1)
    write_task(os.path.join(task_dir, "valid.jsonl"), 21, seed=2, flip=0.25)
    runs = run_on_ranks(4, _bert_runs, task_dir, str(tmp_path))[0]
    (ref_losses, ref_counts, ref_best), (losses, counts, best) = runs["reference"], \
        runs["lightning"]
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 9))
    _assert_same(losses, ref_losses, 1e-6)
    assert [tuple(c) for c in counts] == [tuple(c) for c in ref_counts] and len(counts) == 3
    assert best == ref_best
