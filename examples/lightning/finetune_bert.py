"""Finetune BERT on sentence pairs with PyTorch Lightning's Trainer on megalite (TP2 x DP).

One node, 4 processes (TP2 x DP2):
    torchrun --nproc_per_node 4 examples/lightning/finetune_bert.py --num-nodes 1
SLURM: examples/lightning/finetune_bert.sbatch. The flags after the script's own are
finetune_bert.py's (default: all-MiniLM-L6-v2 on the built-in next-sentence task), e.g.
`-- --train-data train.jsonl --valid-data dev.jsonl --export-dir out_hf`. Validation
accuracy is logged after every epoch (`valid_accuracy`), the best epoch exported at the end.
"""
import argparse
import importlib.util

import pytorch_lightning as pl

from megalite.lightning import MegaliteStrategy
from megalite.tasks.lightning import BertClassificationModule


def logger(save_dir: str):
    """TensorBoard when tensorboard is installed, else CSV files."""
    if importlib.util.find_spec("tensorboard"):
        return pl.loggers.TensorBoardLogger(save_dir)
    return pl.loggers.CSVLogger(save_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=4, help="processes per node")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--log-dir", default="lightning_logs/bert")
    args, flags = parser.parse_known_args()
    module = BertClassificationModule([f for f in flags if f != "--"])
    trainer = pl.Trainer(strategy=MegaliteStrategy(tp=args.tp), num_nodes=args.num_nodes,
                         devices=args.devices, logger=logger(args.log_dir),
                         callbacks=[pl.callbacks.LearningRateMonitor()],
                         num_sanity_val_steps=0, enable_checkpointing=False)
    trainer.fit(module)  # --epochs of finetune_bert.py decide the steps


if __name__ == "__main__":
    main()
