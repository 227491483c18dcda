"""What is trained: a task gives the loop its model and data, the loss of a batch, eval, the tokens a batch
holds, and the final export. The loop (loop.py) knows nothing else of the model or the data.

The tasks: causal-LM training (`causal_lm.CausalLM`, the default), sequence classification with a pretrained
transformers model (`seq_cls.SeqCls`), image classification (`image_cls.ImageCls`), and the user's own model, datasets, loss and metrics by `_target_`
(`custom.Custom`); the interface is `Task`, in base.py;
registry.py picks one for a config.
"""
