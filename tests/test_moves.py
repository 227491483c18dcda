"""A run that moves: the data order at any world, and the export's refusals. The moves themselves run in
test_mesh.py (from its 4-process meshes), test_zero_on_cpu.py (ZeRO-3 to DDP), test_finetune.py (LoRA's export) and
test_custom_task.py (a custom model's export)."""

from __future__ import annotations

import pytest
import torch


class Accelerator:
    """What `micro_batches` asks of an Accelerator: Accelerate's own skip."""

    from accelerate.data_loader import skip_first_batches as _skip

    skip_first_batches = staticmethod(_skip)


def steps_at(world: int, grad_accum: int, start: int, stop: int, n: int, batch: int = 4) -> list[list[int]]:
    """The examples each optimizer step trains on, from step `start` to `stop`, with `world` ranks' loaders as
    xtrain prepares them (Accelerate's seedable sampler, sharded by rank, lean)."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, TensorDataset

    from xtrain.engine import sampler

    ranks = []
    for rank in range(world):
        loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(0))
        loader = prepare_data_loader(loader, num_processes=world, process_index=rank, put_on_device=False,
                                     use_seedable_sampler=True, data_seed=0)
        sampler.lean(loader, batch * grad_accum * world)
        ranks.append(sampler.micro_batches(Accelerator, loader, start * grad_accum))
    return [sorted(i for batches in ranks for _ in range(grad_accum) for i in next(batches)[0].tolist())
            for _ in range(start, stop)]


def test_the_data_order_continues_exactly_at_any_world_that_keeps_the_effective_batch():
    """203 examples, an effective batch of 16: an epoch is 12 whole steps (192 examples). 4 ranks for 7 steps, 2 for
    12 (into the second epoch), 1 for 11: every step trains on the examples the unbroken 4 ranks' step does, and
    each example is seen once per epoch."""
    unbroken = steps_at(4, 1, 0, 30, 203)
    moved = steps_at(4, 1, 0, 7, 203) + steps_at(2, 2, 7, 19, 203) + steps_at(1, 4, 19, 30, 203)
    assert moved == unbroken
    for epoch in (unbroken[:12], unbroken[12:24]):
        seen = [i for step in epoch for i in step]
        assert len(seen) == len(set(seen)) == 192
    assert steps_at(1, 4, 0, 12, 203) == unbroken[:12]  # from the start, too


def export(*argv: str) -> None:
    from xtrain.commands.export import main

    main([str(a) for a in argv])


def test_export_refuses_what_it_cannot_do_in_one_line(short_run, tmp_path, capsys):
    steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in sorted((short_run / "checkpoints").iterdir()))
    for argv, words in [((short_run, "step=7"), ["step=7: no checkpoint at that step", f"it has step {steps}"]),
                        ((short_run, f"out={short_run}"), ["exists already; give a new directory"]),
                        ((tmp_path,), ["not a run dir (no run.yaml)"]),
                        ((short_run, "steps=10"), ["takes step=N and out=DIR"])]:
        with pytest.raises(SystemExit) as ended:
            export(*argv)
        err = capsys.readouterr().err
        assert ended.value.code == 2 and err.count("\n") == 1 and all(w in err for w in words), err
