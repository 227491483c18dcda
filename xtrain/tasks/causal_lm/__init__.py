"""Causal-LM training, the default task: task.py (`CausalLM`: data, loss per token, eval with perplexity,
sample answers, the export) and model.py (transformers causal LMs, from a config or pretrained). Its data is
prepared by data/ (token blocks, chat examples), before the ranks start."""
