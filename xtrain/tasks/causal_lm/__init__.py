"""Causal-LM training, the default task: task.py (`CausalLM`: loss per token, eval with perplexity, sample answers,
the export), model.py (transformers causal LMs, from a config or pretrained), and its data, prepared once before
the ranks start: corpus.py (documents → tokenize.py's token ids → a cache entry of whole blocks, read by
blocks.py) or, for `data=sft`, chat.py (rendering and the answer mask) and sft.py (the examples' entry, packed
or one per item)."""
