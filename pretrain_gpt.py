"""Pretrain a GPT model: `python pretrain_gpt.py` trains a small GPT on the built-in corpus.

Multi-rank: `torchrun --nproc_per_node 8 pretrain_gpt.py --tp 2 --pp 2 --dp 2`. Own data:
`--data-path PREFIX --tokenizer TOKENIZER`; continue a checkpoint: `--load DIR`. Every flag:
`python pretrain_gpt.py --help`; the task is megalite/tasks/gpt.py.
"""
from megalite.tasks import gpt

if __name__ == "__main__":
    gpt.main()
