"""The splits of a classification finetuning task as its config section names them (the
`finetune` section, megalite.tasks.bert.FinetuneConfig): local files
or `datasets` hub splits with their columns, or the built-in next-sentence task; and the
padding that makes the evaluation set whole global batches. Bad input: one-line ValueError.
"""
import os

import torch

from megalite.data.finetune import COLUMNS, PairExamples, read_pairs
from megalite.data.finetune_builtin import builtin_pair_task


def _read(source: str, split: str, **columns) -> PairExamples:
    """read_pairs, with a missing file or a failing `datasets` hub load as one ValueError."""
    if os.path.splitext(source)[1] and not os.path.isfile(source):
        raise ValueError(f"{source}: no such file")
    try:
        examples = read_pairs(source, split=split, **columns)
    except ValueError:
        raise
    except Exception as error:  # datasets' offline / not-found errors, csv or decoding errors
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{source}: cannot read examples ({reason})") from None
    if not examples.labels:
        raise ValueError(f"{source}: no examples")
    return examples


def read_examples(ft, seed: int) -> tuple[PairExamples, PairExamples]:
    """(train, validation) examples of the `finetune` section `ft`: the configured files / hub
    splits, or the built-in task."""
    if ft.train_data is None:
        if ft.valid_data:
            raise ValueError("--valid-data needs --train-data (the built-in task holds out "
                             "its own documents)")
        return builtin_pair_task(seed)
    if ft.valid_data is None and os.path.isfile(ft.train_data):
        raise ValueError(f"--valid-data is required with a local --train-data ({ft.train_data})")
    names = [flag or preset for flag, preset in zip(
        (ft.sentence1_column, ft.sentence2_column, ft.label_column), COLUMNS[ft.columns])]
    columns = dict(num_labels=ft.num_labels, sentence1=names[0],
                   sentence2=None if ft.single_sentence else names[1], label=names[2])
    return (_read(ft.train_data, ft.train_split, **columns),
            _read(ft.valid_data or ft.train_data, ft.valid_split, **columns))


def pad_to_multiple(data: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Append copies of row 0 with label -1 (not counted) up to a multiple of `multiple` rows."""
    extra = -len(data["labels"]) % multiple
    padded = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in data.items()}
    padded["labels"][len(data["labels"]):] = -1
    return padded
