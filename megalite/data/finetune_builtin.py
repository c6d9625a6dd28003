"""The built-in finetuning task: does sentence B follow sentence A in the same document?

Documents are given texts, by default the topics of Python's `help()` text
(`pydoc_data.topics`, in every standard library, so the task works offline). Each
prose sentence A that has a successor is paired, with probability 1/2, with that
successor (label 0) or with a sentence of another document of the same split
(label 1): BERT's next-sentence convention. Whole documents are held out for
validation, so training never sees a validation document. Deterministic for a seed
(and a Python version).
"""
import random
import re

from megalite.data.finetune import PairExamples

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def document_sentences(text: str, min_words: int = 4) -> list[str]:
    """Prose sentences of a text: indented (code, grammar) and heading blocks are skipped."""
    sentences = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if not lines or lines[0].startswith(" ") or set(lines[-1]) <= set("*=-"):
            continue
        prose = " ".join(line.strip() for line in lines)
        sentences += [s for s in _SENTENCE_END.split(prose) if len(s.split()) >= min_words]
    return sentences


def help_topic_texts() -> list[str]:
    """The `pydoc_data.topics` help texts, in topic-name order."""
    from pydoc_data.topics import topics
    return [topics[name] for name in sorted(topics)]


def _pairs(documents: list[list[str]], rng: random.Random) -> PairExamples:
    first, second, labels = [], [], []
    for d, doc in enumerate(documents):
        for a, following in zip(doc, doc[1:]):
            if rng.random() < 0.5:
                other = rng.choice([i for i in range(len(documents)) if i != d])
                following, label = rng.choice(documents[other]), 1
            else:
                label = 0
            first.append(a)
            second.append(following)
            labels.append(label)
    return PairExamples(first, second, labels)


def builtin_pair_task(seed: int = 1234, valid_fraction: float = 0.1,
                      texts: list[str] | None = None) -> tuple[PairExamples, PairExamples]:
    """(train, validation) examples from `texts` (default: the help topics); validation
    holds out whole documents (at least two, so that negatives exist)."""
    documents = [doc for doc in map(document_sentences, texts or help_topic_texts())
                 if len(doc) >= 2]
    if len(documents) < 4:
        raise ValueError(f"need at least 4 documents of 2+ sentences, got {len(documents)}")
    rng = random.Random(seed)
    rng.shuffle(documents)
    n_valid = max(2, round(valid_fraction * len(documents)))
    return _pairs(documents[n_valid:], rng), _pairs(documents[:n_valid], rng)
