"""Finetune a pretrained BERT for sentence-pair (or single-sentence) classification.

`python finetune_bert.py` finetunes all-MiniLM-L6-v2 (shipped offline) on the built-in
next-sentence task; own data: `--pretrained BERT_DIR --train-data train.jsonl --valid-data
dev.jsonl --export-dir out_hf`. Multi-rank: `torchrun --nproc_per_node 4 finetune_bert.py
--tp 2 --pp 2`. Every flag: `python finetune_bert.py --help`; the task is
megalite/tasks/bert.py.
"""
from megalite.tasks import bert

if __name__ == "__main__":
    bert.main()
