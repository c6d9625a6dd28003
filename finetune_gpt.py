"""Chat (supervised) finetuning of a GPT-family model: the loss on the assistant's tokens.

`python finetune_gpt.py` finetunes SmolLM2-135M-Instruct (shipped offline) on the built-in
chat set; own data: `--pretrained MODEL --train-data train.jsonl --valid-data dev.jsonl
--export-dir out_hf`. Multi-rank: `torchrun --nproc_per_node 4 finetune_gpt.py --tp 2 --pp 2`.
Every flag: `python finetune_gpt.py --help`; the task is megalite/tasks/sft.py.
"""
from megalite.tasks import sft

if __name__ == "__main__":
    sft.main()
