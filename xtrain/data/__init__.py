"""Data: a corpus prepared once into a cache of token blocks, then read by every rank.

sources.py (documents, in order, from files, datasets or the bundled corpus) → tokenize.py (token ids, in
parallel) → cache.py (the content-keyed entry: tokens, the split, its record; once, under a lock) →
blocks.py (the train and val sets, a block per read). Instruction and chat examples (`data=sft`) take
chat.py (rendering and the answer mask) and sft.py (their entry, packed or one per item) instead;
lm.py picks between the two. Labelled records (labelled.py) and images (images.py) use the same cache. `lm.prepare` runs outside any training collective: in the
driver before workers start, in a SLURM job before torchrun, or ahead of time (`python -m xtrain.prepare`).

May import: core, config.
"""
