"""Each rank's peak memory over one run: host RSS and, on a GPU, device memory. Both are reset as a run starts,
so that points a sweep trains one after another in the same process each report their own peak. (torch is imported
where it is used: the CLI imports this module, and must not load torch before it has set its threads.)"""

from __future__ import annotations

import resource
from pathlib import Path

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def size(n_bytes: float) -> str:
    """Bytes as the plan and the errors show them (decimal units)."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"


def give_back_freed() -> None:
    """Return the heap's freed pages to the system (glibc keeps them otherwise: training a tokenizer leaves ~200 MB
    of them in the process that then prepares the corpus). Nothing where the C library has no `malloc_trim`."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peaks() -> None:
    """From here on, the peaks are this run's (Linux: the kernel's high-water RSS mark, reset by `clear_refs`)."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or a kernel that does not allow it: the peak since the process started
        pass
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_rss() -> int:
    """This process's peak resident memory since `reset_peaks`, in bytes (file pages it maps included)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parameter_bytes(model) -> int:
    """The bytes of parameters this rank holds: its shards where they are sharded (FSDP's and TP's DTensors,
    ZeRO-3's partitions)."""
    total = 0
    for p in model.parameters():
        held = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
        total += held.numel() * held.element_size()
    return total


def peaks(accelerator) -> dict[str, list[int]]:
    """Every rank's peaks, gathered (a collective): `peak_rss_bytes`, and on a GPU `peak_device_memory_bytes`
    (allocated: what the caching allocator handed out at most, tensors alone) and `peak_device_reserved_bytes`
    (reserved: what it held from the GPU at most, its cache included; what nvidia-smi counts, less the context)."""
    import torch

    own = [peak_rss()]
    if torch.cuda.is_available():
        own += [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    every = accelerator.gather(torch.tensor([own], device=accelerator.device)).tolist()
    named = {"peak_rss_bytes": [rank[0] for rank in every]}
    if len(own) > 1:
        named["peak_device_memory_bytes"] = [rank[1] for rank in every]
        named["peak_device_reserved_bytes"] = [rank[2] for rank in every]
    return named
