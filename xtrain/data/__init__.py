"""Data preparation outside the ranks, shared by the tasks: sources.py (documents or records, in order, from files,
Hugging Face datasets or the bundled corpus), cache.py (a content-keyed entry, written once under a lock, and
the held-out split), collate.py (batches padded to their longest item), and the classification tasks' prepared
forms: labelled.py (text records with labels) and images.py (image folders and arrays). A causal LM's token blocks
and chat examples are prepared by tasks/causal_lm/. Preparation runs in the driver before workers start, in a
SLURM job before torchrun, or ahead of time (`python -m xtrain.prepare`), never inside a training collective.

May import: core, config.
"""
