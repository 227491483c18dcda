"""How one model is spread over processes: plugins.py (Accelerate's DeepSpeed and FSDP plugins and
accelerate config files, ZeRO bucket sizes, the FSDP block), meta_init.py (FSDP2 from the meta device),
compiling.py (torch.compile regions), fp8.py (torchao's fp8: its recipe and the layers it converts),
estimate.py (model-state memory per device, for any model) and cpu_seams.py (the test seams that run the
GPU-only paths on CPUs).

May import: core, config, data.
"""
