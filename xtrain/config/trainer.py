"""The `trainer` settings: the batch, the optimizer and its schedule, evals, checkpoints, the model kept, callbacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from xtrain.config import habits
from xtrain.config.fields import setting
from xtrain.config.task import Direction, Export, check_target_node, given, unset
from xtrain.core.errors import ConfigError, non_negative, positive

DEFAULT_STEPS = 300
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8}  # the default optimizer's settings (trainer.optimizer's description)


@dataclass
class TrainerConfig:
    batch_size: int = 16
    """Per-device micro batch, in sequences."""
    grad_accum: int = 1
    """Micro batches per optimizer step."""
    max_steps: Optional[int] = None
    """Optimizer steps; default: 300, or with `max_epochs` that many epochs' steps."""
    max_epochs: Optional[int] = None
    """Train this many epochs (an epoch: the train examples over the effective batch, whole steps only): the run
    works out `max_steps` once its data is prepared (the warmup's default from it too), logs it and records it in
    run.yaml (a `# max_epochs=...` line; `trainer.max_steps` stays unset there). Not with `max_steps`."""
    limit_train_batches: int = 0
    """Train on only the first this many micro-batches of examples (per process), shuffled each epoch as usual: a
    quick run on a few batches. 0: all of them."""
    limit_val_batches: int = 0
    """Evaluate on only the first this many batches of the validation set. 0: all of them."""
    overfit_batches: int = 0
    """Train on the same first this many micro-batches, in order, every epoch, and evaluate on them too: a model
    that cannot drive this loss towards zero has a bug. 0: off."""
    lr: float = 2e-3
    """Peak learning rate: AdamW's, reached after warmup_steps, then cosine decay to min_lr_ratio x lr; with a
    `trainer.scheduler` of your own that takes its own peak (`max_lr`: OneCycleLR, CyclicLR), its `max_lr` where the
    node leaves it unset."""
    warmup_steps: Optional[int] = None
    """Optimizer steps of linear warmup from 0 to lr; default: a tenth of max_steps (30 of the default 300), recorded
    in run.yaml as a number."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (not on biases and norms)."""
    max_grad_norm: float = 1.0
    """0 disables clipping."""
    eval_every: int = setting(100, free=True)
    """Evaluate every this many optimizer steps (and at step 0 and the end)."""
    save_every: Any = setting(100, free=True)
    """Write a checkpoint every this many optimizer steps (and at the end); `auto`: the interval that loses the least
    time to saves and failures together (Young/Daly's, from the measured time a save blocks training, the time a step
    takes and `cluster.mtbf_hours` or the run's own restarts), chosen after a first save that measures it and again on
    each resume; run.yaml records the number it chose."""
    async_save: Any = setting("auto", free=True)
    """Write checkpoints behind training: a save blocks the step only while the state is copied off the training
    tensors (into host memory, pinned on GPUs), and its files are written while training goes on; it is published
    (complete, verified, renamed into place) once every rank's files are in. `auto` (run.yaml records what it became):
    on wherever it is exact (DDP, one process, FSDP2 and its meshes); off under ZeRO, whose engine writes its own
    checkpoints in step. Host memory for one copy of each rank's model and optimizer state is held for it (the plan
    counts it)."""
    keep_checkpoints: int = setting(2, free=True)
    """Checkpoints kept in the run dir: the newest this many."""
    log_every: int = setting(10, free=True)
    """Log a train row (metrics.jsonl, trackers, a log line) every this many optimizer steps."""
    seed: int = 0
    """Seeds the model's init, the data order and every rank's RNGs."""
    fused_optimizer: Any = "auto"
    """AdamW as one fused kernel over all parameters (torch's `fused=True`), equal to the foreach update up to
    rounding: `auto` (run.yaml records what it became) fuses where the run trains on GPUs with DDP or FSDP (not
    under ZeRO, whose engine steps the optimizer, nor on CPUs, where it does not pay); `true` or `false` to choose.
    Not with a `trainer.optimizer` of your own, nor under ZeRO-Offload, which steps with DeepSpeedCPUAdam."""
    sample_prompts: List[str] = setting(factory=list, free=True)
    """Prompts answered greedily at each eval (user turns, rendered with the chat template where the tokenizer
    has one): logged, written to metrics.jsonl (`sample/<i>`) and sent to the trackers."""
    sample_max_tokens: int = setting(48, free=True)
    """New tokens per answer to `sample_prompts` (greedy)."""
    compile: bool = False
    """torch.compile (inductor) per transformer block, in place: faster steps on GPUs after a compile at the
    start; losses equal eager's up to rounding. DDP, FSDP2 and ZeRO; not FSDP1."""
    compile_tuning: bool = False
    """With `trainer.compile`: inductor times launch configurations of each GPU (Triton) kernel it generates and keeps
    the fastest (coordinate-descent and pointwise tuning; matmuls stay cuBLAS's). Longer compiles, for fp8's scaling
    kernels faster steps (see the speed guide). GPUs only: a CPU's compiled kernels are C++."""
    monitor: str = setting("val_loss", free=True)
    """The eval value that judges the model: `val_loss`, `val_ppl` (language models) or `val_<metric>` of
    `task.metrics` (Lightning's form `val/accuracy` is taken too). It picks what `model/` holds (`export=best`), drives `early_stop_patience`, and ranks a grid
    sweep's points."""
    monitor_direction: Direction = setting(Direction.auto, free=True)
    """Whether a higher or a lower `monitor` is better; `auto` knows the built-in values and metrics, torchmetrics'
    `higher_is_better` and a `task.metrics` entry's `direction` (a function metric without one needs `maximize` or
    `minimize` here)."""
    export: Export = setting(Export.last, free=True)
    """What `model/` holds: the `last` model, or the `best` one by `monitor` (exported at each eval that improves
    it; result.json's `model_step` says which, `model_eval` what it scored). Sweeps and studies rank a run by what
    the model it kept scored."""
    early_stop_patience: int = setting(0, free=True)
    """Stop when this many evals in a row have not improved `monitor` (by more than `early_stop_min_delta`): at that
    step boundary, with its checkpoint and `model/`; the run is `completed` and `early_stop` records why. 0: never."""
    early_stop_min_delta: float = setting(0.0, free=True)
    """How much `monitor` must improve on its best for an eval to count as an improvement."""
    optimizer: Dict[str, Any] = field(default_factory=unset)
    """An optimizer of your own: `trainer.optimizer._target_=torch.optim.SGD` (its arguments:
    `+trainer.optimizer.momentum=0.9`); it gets the parameters (weight decay on matrices only, `trainer.weight_decay`,
    unless it is given its own `weight_decay`) and `trainer.lr` (unless given its own `lr`). Unset: AdamW with
    betas (0.9, 0.95) and eps 1e-8 (torch's and the HF Trainer's default betas are (0.9, 0.999))."""
    scheduler: Dict[str, Any] = field(default_factory=unset)
    """A learning-rate schedule of your own: `trainer.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR` (its
    arguments: `+trainer.scheduler.pct_start=0.2`), stepped once per optimizer step; it gets the optimizer,
    `trainer.max_steps` as `total_steps`, `num_training_steps` or `T_max` where it takes one, and `trainer.lr` as
    `max_lr` where it takes one and the node does not set it (set there, `trainer.lr` does nothing: a run says so, a
    sweep over it is refused). Unset: linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` x
    `lr`."""
    callbacks: List[Any] = field(default_factory=list)
    """Objects by `_target_` whose hooks the loop calls, named as in Lightning: `on_train_start`,
    `on_train_batch_end`, `on_validation_end`, `on_save_checkpoint`, `on_train_end`, `on_exception` (a failure or an
    interruption; xtrain/engine/callbacks.py); on the main process unless the callback sets `every_rank = True`. A
    method named like a hook that is not one (Lightning's `on_validation_epoch_end`) is refused."""

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_epochs is not None:
            raise ConfigError(f"trainer.max_steps={self.max_steps} with trainer.max_epochs={self.max_epochs}: give one "
                              "(max_epochs works out the steps from the data)")
        if self.max_epochs is None and self.max_steps is None:
            self.max_steps = DEFAULT_STEPS
        for name in ("batch_size", "grad_accum", "lr", "eval_every", "log_every", "sample_max_tokens"):
            positive(f"trainer.{name}", getattr(self, name))
        for name in ("max_steps", "max_epochs"):
            if getattr(self, name) is not None:
                positive(f"trainer.{name}", getattr(self, name))
        for name in ("limit_train_batches", "limit_val_batches", "overfit_batches"):
            non_negative(f"trainer.{name}", getattr(self, name))
        if self.overfit_batches and self.limit_train_batches:
            raise ConfigError(f"trainer.overfit_batches={self.overfit_batches} with trainer.limit_train_batches="
                              f"{self.limit_train_batches}: give one (overfit_batches trains on that many, in order)")
        self.monitor = habits.eval_value(self.monitor)  # (Lightning's `val/acc`: run.yaml records `val_accuracy`)
        if self.save_every != "auto" and not (isinstance(self.save_every, int) and not isinstance(self.save_every, bool)
                                               and self.save_every > 0):
            raise ConfigError(f"trainer.save_every={self.save_every}: must be a positive number of steps, or auto")
        if self.warmup_steps is None and self.max_steps is not None:
            self.warmup_steps = self.max_steps // 10
        for name in ("weight_decay", "max_grad_norm"):
            non_negative(f"trainer.{name}", getattr(self, name))
        if self.warmup_steps is not None:
            non_negative("trainer.warmup_steps", self.warmup_steps)
        if self.keep_checkpoints < 1:
            raise ConfigError(f"trainer.keep_checkpoints={self.keep_checkpoints}: must be >= 1 (resume needs one)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        non_negative("trainer.early_stop_patience", self.early_stop_patience)
        non_negative("trainer.early_stop_min_delta", self.early_stop_min_delta)
        for name in ("fused_optimizer", "async_save"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ConfigError(f"trainer.{name}={getattr(self, name)}: choose auto, true or false")
        check_target_node("trainer.optimizer", self.optimizer)
        check_target_node("trainer.scheduler", self.scheduler)
        for i, node in enumerate(self.callbacks):
            if not given(node):
                raise ConfigError(f"trainer.callbacks[{i}]={node}: give {{_target_: mymodule.MyCallback}}")
        if self.max_steps is not None:
            self.check_warmup()

    def with_epochs(self, steps_per_epoch: int) -> None:
        """`max_epochs` as steps, now that an epoch's steps are known (the warmup's default from them)."""
        self.max_steps = self.max_epochs * steps_per_epoch
        if self.warmup_steps is None:
            self.warmup_steps = self.max_steps // 10
        self.check_warmup()

    def check_warmup(self) -> None:
        if self.warmup_steps > self.max_steps and not given(self.scheduler):
            raise ConfigError(f"trainer.warmup_steps={self.warmup_steps}: more than trainer.max_steps={self.max_steps}, "
                              f"so the run would never reach trainer.lr; use trainer.warmup_steps<={self.max_steps}, "
                              "or leave it unset (a tenth of max_steps)")
