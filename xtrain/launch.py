"""From a validated RunConfig to a running training: preflight checks, run dir, workers.

The driver checks everything it can before anything starts, creates the run dir and
writes `run.yaml` (plus the equivalent `accelerate_config.yaml` / `deepspeed.json`);
workers only ever read the run dir.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import yaml

from xtrain import checkpoint, data, hardware, model, plan, plugins, run_dir, stopping
from xtrain.config import ClusterKind, ConfigError, ModelSource, Offload, RunConfig, Strategy
from xtrain.files import write_atomic

log = logging.getLogger("xtrain")

ACCELERATE_CONFIG = "accelerate_config.yaml"
DEEPSPEED_CONFIG = "deepspeed.json"


def preflight(cfg: RunConfig) -> plugins.ModelFacts:
    """Checks of the machine and the world outside the config (files, models, checkpoints); the model's facts."""
    hardware.check(cfg)
    c = cfg.cluster
    if c.kind is ClusterKind.slurm:
        from xtrain import slurm

        slurm.check(cfg)
    elif c.nodes > 1 and c.main_process_port is None:
        raise ConfigError(
            f"cluster.main_process_port is empty: cluster.nodes={c.nodes} needs the same port on every node, "
            "e.g. cluster.main_process_port=29500"
        )
    gpus = hardware.node_gpus(cfg)
    if gpus and c.processes_per_node > gpus:
        where = f"cluster.gpus_per_node={gpus}" if hardware.submitting_to_slurm(cfg) else f"this node has {gpus} GPU(s)"
        raise ConfigError(
            f"cluster.num_processes={c.num_processes}: {where}; use cluster.num_processes<={gpus} (or auto)"
        )
    nvme = cfg.strategy.nvme_path
    nvme_offloads = [f"strategy.{name}=nvme" for name in ("offload_optimizer", "offload_param")
                     if getattr(cfg.strategy, name) is Offload.nvme]
    if nvme_offloads and not os.path.isdir(nvme):
        raise ConfigError(f"strategy.nvme_path={nvme}: no such directory")
    if nvme_offloads and not hardware.async_io_available():
        raise ConfigError(
            f"{nvme_offloads[0]}: DeepSpeed's async_io op cannot be built here (libaio headers missing); "
            "install them (apt-get install libaio-dev) or offload to cpu instead"
        )
    data.check(cfg.data)
    if cfg.model.source is ModelSource.pretrained:
        model.pretrained_config(cfg.model)
    _, facts = plan.model_facts(cfg)  # checks strategy.wrap_layer against the model
    resume_from = checkpoint.resolve(cfg.resume, cfg.run_dir, checkpoint.identity(cfg))
    if resume_from is not None:
        done = checkpoint.read_state(resume_from)["step"]
        if done >= cfg.trainer.max_steps:
            raise ConfigError(
                f"resume={cfg.resume}: {resume_from} has already trained {done} steps; "
                f"trainer.max_steps={cfg.trainer.max_steps} leaves nothing to do: raise trainer.max_steps"
            )
    return facts


def export_accelerate_files(cfg: RunConfig, facts: plugins.ModelFacts, path: Path) -> None:
    """The same run for plain `accelerate launch --config_file <run dir>/accelerate_config.yaml`."""
    ds_path = None
    if plugins.is_zero(cfg):
        ds_path = path / DEEPSPEED_CONFIG
        ds = plugins.deepspeed_config(cfg, facts, plugins.load_user_deepspeed_config(cfg))
        write_atomic(ds_path, json.dumps(ds, indent=2) + "\n")
    exported = plugins.accelerate_config(cfg, facts, str(ds_path), cuda=hardware.node_gpus(cfg) > 0)
    write_atomic(path / ACCELERATE_CONFIG, yaml.safe_dump(exported))


def wait_for_run_dir(cfg: RunConfig, since: float) -> Path:
    """Nodes other than 0 use the run dir node 0 writes (a shared filesystem): wait for its run.yaml."""
    path = Path(cfg.run_dir)
    deadline = time.time() + cfg.cluster.timeout_s
    while not ((path / run_dir.RUN_CONFIG).exists() and (path / run_dir.RUN_CONFIG).stat().st_mtime >= since - 2):
        if time.time() > deadline:
            raise ConfigError(
                f"cluster.node_rank={cfg.cluster.node_rank}: node 0 wrote no run.yaml in run_dir={cfg.run_dir} within "
                f"cluster.timeout_s={cfg.cluster.timeout_s}; start node 0 with the same run_dir (on a shared filesystem)"
            )
        time.sleep(0.2)
    return path


def launch(cfg: RunConfig) -> dict:
    """The CLI's single run: check, write the run dir, train."""
    started = time.time()
    cfg = hardware.resolve_processes(cfg)
    if cfg.cluster.kind is ClusterKind.slurm:
        from xtrain import slurm

        return slurm.launch(cfg)
    if cfg.dry_run:
        the_plan = plan.make(cfg, hardware.refusal(cfg), hardware.local_gpu_gb())
        print(plan.render(the_plan))
        return {"dry_run": True, "fits": the_plan.fits}
    return run(cfg, prepare(cfg, started))


def prepare(cfg: RunConfig, started: float | None = None) -> Path:
    """Preflight, then the run dir with run.yaml (node 0), or node 0's run dir once written (other nodes)."""
    facts = preflight(cfg)
    if cfg.cluster.node_rank > 0:
        return wait_for_run_dir(cfg, started or time.time())
    return write_run_dir(cfg, facts)


def write_run_dir(cfg: RunConfig, facts: plugins.ModelFacts) -> Path:
    """The run dir with run.yaml and the equivalent accelerate files (after `preflight`)."""
    path = run_dir.prepare(cfg)
    export_accelerate_files(cfg, facts, path)
    return path


def run(cfg: RunConfig, path: Path) -> dict:
    """Train the prepared run dir: in this process, or N workers under torchrun. A run stopped on request
    (SIGTERM, SIGUSR1/2) at a step boundary raises `stopping.Stopped`."""
    log.info("run dir: %s", path)
    # In-process (no spawn cost) only for DDP: Accelerate sets up FSDP and DeepSpeed only under a
    # launcher's environment; in-process it would silently drop FSDP, and DeepSpeed would look for MPI.
    if cfg.cluster.world_size == 1 and cfg.strategy.name is Strategy.ddp:
        from xtrain.trainer import train

        with stopping.on(stopping.GRACEFUL):
            result = train(path)
    else:
        from xtrain import multiprocess

        log.info(
            "launching %d x %d processes (node %d), %d CPU threads each",
            cfg.cluster.nodes, cfg.cluster.processes_per_node, cfg.cluster.node_rank,
            multiprocess.threads_per_process(cfg.cluster.processes_per_node),
        )
        result = multiprocess.run(cfg, path)
    stop = result.get("stop") if result.get("status") == "interrupted" else None
    if stop:
        raise stopping.Stopped(
            f"stopped by {stop['signal']} at step {stop['step']} with a checkpoint; to continue, run the same command with "
            f"run_dir={path} resume=auto", getattr(signal.Signals, stop["signal"], signal.SIGTERM),
        )
    return result


def run_recorded(cfg: RunConfig, path: Path) -> dict:
    """`run`, and whatever ends it is in result.json (a run that fails before training starts writes none)."""
    try:
        return run(cfg, path)
    except BaseException as err:
        interrupted = isinstance(err, KeyboardInterrupt) or getattr(err, "exit_code", 1) >= 128
        run_dir.record_end(path, "interrupted" if interrupted else "failed", one_line(err))
        raise


def one_line(err: BaseException) -> str:
    from xtrain.multiprocess import LaunchFailed

    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text if isinstance(err, (ConfigError, LaunchFailed)) else f"{type(err).__name__}: {text}"


def main() -> None:
    """`python -m xtrain.launch RUN_DIR`: train a run dir that was prepared already (a sweep's point in a
    process of its own). Exit 0 done, 1 failed, 2 a config error, 130 interrupted, 128+N stopped by signal N
    at a step boundary (resumable)."""
    import logging.config
    import sys
    from importlib.resources import files

    from xtrain import config
    from xtrain.worker import _on_sigterm

    logging.config.dictConfig(yaml.safe_load((files("xtrain.conf") / "hydra/job_logging/xtrain.yaml").read_text()))
    signal.signal(signal.SIGTERM, _on_sigterm)
    path = Path(sys.argv[1])
    try:
        run_recorded(config.load(str(path / run_dir.RUN_CONFIG)), path)
    except ConfigError as err:
        print(f"xtrain: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except stopping.Stopped as err:
        print(f"xtrain: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except Exception as err:
        print(f"xtrain: error: {one_line(err)}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 1))


if __name__ == "__main__":
    main()
