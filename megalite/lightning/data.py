"""megalite's data for Lightning: the task's own streams (task.batches: this DP rank's
microbatches in megalite's sampling order, resumable by consumed samples), one list of
microbatches per optimizer step, so Lightning's batch is megalite's step."""
import itertools
from collections.abc import Iterator

import pytorch_lightning as pl


class StepBatches:
    """An endless iterable of steps: each the next `num_microbatches` microbatches of `stream`
    (a middle pipeline stage's stream holds positions only). No length: the run ends at
    Trainer(max_steps) or the task's --train-iters."""

    def __init__(self, stream: Iterator, num_microbatches: int) -> None:
        self.stream, self.num_microbatches = stream, num_microbatches

    def __iter__(self) -> Iterator[list]:
        while True:
            yield list(itertools.islice(self.stream, self.num_microbatches))


class MegaliteDataModule(pl.LightningDataModule):
    """The data of a `MegaliteModule`'s task on its grid. Its train stream starts after the
    samples the run has consumed (a resumed run continues the order); a validation point is
    one Lightning batch, the module evaluating --eval-iters steps of the task's valid stream
    and running the task's own validation (e.g. BERT's accuracy)."""

    def __init__(self, module) -> None:
        super().__init__()
        self.module = module
        self._train: Iterator | None = None

    def _streams(self) -> None:
        """Build the task's streams once (collective over the world: the index is built by
        rank 0)."""
        if self._train is None:
            run = self.module.run
            self._train, run.valid_batches = run.task.batches(run.configs, run.layout,
                                                              run.consumed)

    def train_dataloader(self) -> StepBatches:
        self._streams()
        return StepBatches(self._train, self.module.run.layout.num_microbatches)

    def val_dataloader(self) -> list[int]:
        """One batch per validation point."""
        self._streams()
        return [0]
