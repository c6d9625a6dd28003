"""megalite inside PyTorch Lightning (docs/lightning_horovod.md).

    from megalite.tasks.lightning import GPTModule
    trainer = pl.Trainer(strategy=MegaliteStrategy(tp=2, pp=2), max_steps=100)
    trainer.fit(GPTModule(["--num-layers", "4", "--hidden-size", "256", ...]))

- strategy.py: MegaliteStrategy (process grid, model wrapping, the step, checkpoints);
- module.py: MegaliteModule (any megalite Task as a LightningModule); the entry scripts'
  tasks as modules (GPTModule, ChatSFTModule, BertClassificationModule) are in
  megalite.tasks.lightning, as only megalite.tasks imports the tasks;
- data.py: MegaliteDataModule (the task's streams, one list of microbatches per step);
- environment.py: MegaliteEnvironment (ranks started outside the Trainer).
"""
from megalite.lightning.data import MegaliteDataModule
from megalite.lightning.environment import MegaliteEnvironment
from megalite.lightning.module import MegaliteModule
from megalite.lightning.strategy import MegaliteStrategy

__all__ = ["MegaliteStrategy", "MegaliteModule", "MegaliteDataModule", "MegaliteEnvironment"]
