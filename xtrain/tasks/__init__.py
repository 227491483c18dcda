"""What is trained: a task gives the loop its model and data, the loss of a batch, eval, the count of examples or
tokens a batch holds, and the final export. The loop (engine/loop.py) knows nothing else of the model or data.

The tasks: causal-LM training (causal_lm/: the task, its model; the default), sequence classification with a
pretrained transformers model (seq_cls.py), image classification (image_cls.py), and the user's own model,
datasets, loss and metrics by `_target_` (custom.py). The interface is `Task`, in base.py; registry.py picks one
for a config. Beside them: metrics.py (the built-in metrics), lora.py (LoRA for causal_lm and seq_cls),
pretrained.py (a Hugging Face model's config and identity), facts.py (what the strategy code needs of a model)
and exports.py (`xtrain.load_model`).

May import: core, config, data, parallel.
"""
