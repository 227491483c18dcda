"""How one model is spread over ranks: the strategy's home.

dims.py (ParallelDims: pp x dp_replicate x dp_shard x tp, the one effective-batch and data-parallel formula),
base.py (the Parallelism each strategy is: its refusals, plugin settings, launch files, model preparation in order,
its step, evals and export, checkpoint form, memory of its states), one module per strategy (ddp.py, zero.py,
fsdp.py), pipeline.py (pipeline stages around DDP or FSDP2) and strategies.py (a run's Parallelism by its
strategy's name); what they share: plugins.py (the Accelerator's keyword arguments and
accelerate config files), tensor_parallel.py (the model's TP plan), meta_init.py (FSDP2 from the meta device),
compiling.py (torch.compile regions), fp8.py (torchao's fp8), estimate.py (memory per device, for any model).

May import: core, config, data.
"""
