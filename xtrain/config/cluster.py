"""The `cluster` group: which machines run the workers, and what a SLURM job or a Ray job asks for.

Every string that reaches the sbatch script or the srun line is checked here: no control characters (a
newline would start a line of the script), and no secrets in the shell strings (the script and its logs
are files others may read; a secret belongs in the environment, which sbatch passes on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Optional

from xtrain.config.fields import all_free
from xtrain.core.errors import ConfigError, non_negative, positive


class ClusterKind(Enum):
    local = "local"
    slurm = "slurm"
    ray = "ray"


SCRIPT_STRINGS = ("job_name", "partition", "account", "qos", "constraint", "exclude", "time_limit",
                  "container_image", "container_mounts", "container_python")
SHELL_STRINGS = ("setup", "srun_args", "sbatch_args")  # also never sent to a tracker (tracking.hyperparameters)
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD")
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\s*=")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def looks_like_secret(name: str) -> bool:
    """HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, ... (not KEYRING_PATH)."""
    return any(part.endswith(_SECRET_WORDS) for part in name.upper().split("_"))


@all_free  # (where it runs: the effective batch is kept)
@dataclass
class ClusterConfig:
    """What every cluster option reads: the nodes, their processes and the rendezvous. Each option of the `cluster`
    group extends it (`LocalConfig`, `SlurmConfig`): another option's setting is no such setting."""
    kind: ClusterKind = ClusterKind.local
    """Where the run runs: this machine or a SLURM job; each option of the `cluster` group sets it."""
    nodes: int = 1
    """Machines the run spans (one task each under SLURM; several local nodes need node_rank and the rendezvous)."""
    node_rank: int = 0
    """This machine's rank among the nodes (0: the one that writes the run dir)."""
    num_processes: str = "auto"
    """Processes per node: a number, or `auto` (one per GPU of a node, else 1)."""
    main_process_ip: str = "127.0.0.1"
    """Address of node 0, where the rendezvous listens."""
    main_process_port: Optional[int] = None
    """Rendezvous port (one node: a free port is chosen; several nodes: set the same port on each)."""
    timeout_s: int = 600
    """A collective that waits longer than this (a stuck or dead rank) ends the run."""
    gpu_memory_gb: Optional[float] = None
    """Device memory to plan against (dry_run); default: what the local GPU has."""
    check_memory: bool = True
    """A run whose planned memory does not fit (this machine's, or the job's nodes') is refused before it starts;
    false: warned about, and started anyway (the plan's estimate is a lower bound)."""
    mtbf_hours: Optional[float] = None
    """Mean time between failures that end the run (a node lost, a job killed without warning), in hours, for
    `trainer.save_every=auto`; unset, the run's own restarts tell it (see the goodput guide)."""

    NAMES = ()  # the options this schema is the settings of

    def __post_init__(self) -> None:
        if self.kind not in self.NAMES:
            raise ConfigError(f"cluster.kind={self.kind.value}: set by the cluster option; use cluster={self.kind.value}")
        positive("cluster.nodes", self.nodes)
        positive("cluster.timeout_s", self.timeout_s)
        if not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"cluster.node_rank={self.node_rank}: must be in [0, cluster.nodes={self.nodes})")
        if self.num_processes != "auto" and not (self.num_processes.isdigit() and int(self.num_processes) > 0):
            raise ConfigError(f"cluster.num_processes={self.num_processes}: must be a positive number or auto")
        if self.main_process_port is not None and not 0 < self.main_process_port < 65536:
            raise ConfigError(f"cluster.main_process_port={self.main_process_port}: must be a port number (1-65535)")
        if self.gpu_memory_gb is not None:
            positive("cluster.gpu_memory_gb", self.gpu_memory_gb)
        if self.mtbf_hours is not None:
            positive("cluster.mtbf_hours", self.mtbf_hours)

    @property
    def processes_per_node(self) -> int:
        assert self.num_processes != "auto", "launch resolves num_processes=auto first"
        return int(self.num_processes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


@dataclass
class LocalConfig(ClusterConfig):
    """cluster=local: this machine (or, with `nodes` > 1, each machine started by hand with its `node_rank`)."""
    NAMES = (ClusterKind.local,)


@dataclass
class SlurmConfig(ClusterConfig):
    """cluster=slurm: one job, one task per node, each running that node's workers (xtrain/backends/slurm/)."""
    kind: ClusterKind = ClusterKind.slurm
    min_nodes: Optional[int] = None
    """The fewest nodes a job that requeues itself after a stop signal may continue on: it asks for the
    partition's nodes that can still run (not drained or down), at most `nodes`; grad_accum keeps the effective
    batch. Default: `nodes` again."""
    gpus_per_node: str = "auto"
    """GPUs to request on each node: `auto` (every GPU of a node of the partition; none on a CPU partition) or a
    number (0 on a GPU partition: train on the nodes' CPUs). num_processes=auto starts one process per GPU."""
    cpus_per_task: str = "all"
    """CPUs for each node's task (all of that node's workers): `all` (every CPU of a node of the partition, the
    fewest where nodes differ) or a number. Both sbatch and srun get it as --cpus-per-task."""
    mem_gb: Optional[float] = None
    """Memory per node; default: the partition's. A job on CPUs (no GPU asked) is planned against it."""
    time_limit: str = "01:00:00"
    """SLURM's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    partition: Optional[str] = None
    """SLURM: the partition (default: the cluster's default partition)."""
    account: Optional[str] = None
    """SLURM: `--account`."""
    qos: Optional[str] = None
    """SLURM: `--qos`."""
    constraint: Optional[str] = None
    """SLURM: `--constraint` (node features)."""
    exclude: Optional[str] = None
    """Nodes not to run on, e.g. `n[3-4]`."""
    job_name: str = "xtrain"
    """SLURM: the job's name in squeue."""
    sbatch_args: Dict[str, str] = field(default_factory=dict)
    """More `#SBATCH --key=value` lines, e.g. {mail-type: END}."""
    setup: List[str] = field(default_factory=list)
    """Shell lines run before the job's srun (module loads, environment activation)."""
    srun_args: List[str] = field(default_factory=list)
    """SLURM: more arguments for the `srun` line that starts each node's task."""
    container_image: Optional[str] = None
    """Run every node's task in this image (pyxis: srun --container-image); xtrain must be installed in it."""
    container_mounts: Optional[str] = None
    """pyxis --container-mounts, e.g. /data:/data,/scratch:/scratch (the run dir must be visible inside)."""
    container_python: Optional[str] = None
    """The interpreter that runs each node's task; default: `python3` in a container image, else this one."""
    wait: bool = True
    """Follow the submitted job to its end (states, rank 0's log); false: return after submitting."""
    signal_lead_s: int = 120
    """SLURM warns the job this long before its time limit (and on preemption, where the cluster sends
    it): every rank finishes its step, a checkpoint is written, the job requeues itself. Leave time for
    a step and a checkpoint."""
    max_requeues: int = 10
    """Restarts a job may have; a stop signal after that many ends the run `interrupted`, with its
    checkpoint, for `resume=auto` by hand."""

    NAMES = (ClusterKind.slurm,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mem_gb is not None:
            positive("cluster.mem_gb", self.mem_gb)
        if not (self.gpus_per_node == "auto" or self.gpus_per_node.isdigit()):
            raise ConfigError(f"cluster.gpus_per_node={self.gpus_per_node}: must be a number (0 or more) or auto")
        if not (self.cpus_per_task == "all" or self.cpus_per_task.isdigit() and int(self.cpus_per_task) > 0):
            raise ConfigError(f"cluster.cpus_per_task={self.cpus_per_task}: must be a positive number or all")
        minutes = time_limit_minutes(self.time_limit)
        positive("cluster.signal_lead_s", self.signal_lead_s)
        non_negative("cluster.max_requeues", self.max_requeues)
        if self.signal_lead_s >= minutes * 60:
            raise ConfigError(
                f"cluster.signal_lead_s={self.signal_lead_s}: the warning would come before the job starts "
                f"(cluster.time_limit={self.time_limit} is {minutes * 60} s); use a smaller lead or a longer limit"
            )
        _check_min_nodes(self.min_nodes, self.nodes)
        self._check_script_strings()

    def _check_script_strings(self) -> None:
        strings = [(f"cluster.{name}", getattr(self, name)) for name in SCRIPT_STRINGS if getattr(self, name)]
        strings += [(f"cluster.setup[{i}]", line) for i, line in enumerate(self.setup)]
        strings += [(f"cluster.srun_args[{i}]", arg) for i, arg in enumerate(self.srun_args)]
        strings += [(f"cluster.sbatch_args.{key}", f"{key}={value}") for key, value in self.sbatch_args.items()]
        for name, text in strings:
            if _CONTROL.search(str(text)):
                raise ConfigError(
                    f"{name}={str(text)!r}: holds a control character, and it is written into the job's sbatch script "
                    "or srun line (a newline would start a line of its own); remove it"
                )
            if not name.startswith(SHELL_STRINGS, len("cluster.")):
                continue
            for variable in _ASSIGNMENT.findall(str(text)):
                if looks_like_secret(variable):
                    raise ConfigError(
                        f"{name}: {variable}=... looks like a secret, and this string is written into the job's sbatch "
                        f"script (a file others may read); export {variable} in the shell you submit from instead "
                        "(sbatch passes the environment on to the job)"
                    )

    @property
    def gpus(self) -> int:
        """GPUs asked for on each node (cluster=slurm, once resolved from the partition)."""
        assert self.gpus_per_node != "auto", "the SLURM backend resolves gpus_per_node=auto first"
        return int(self.gpus_per_node)


@dataclass
class RayConfig(ClusterConfig):
    """cluster=ray: a Ray cluster's nodes, one task per node in a placement group (see the Ray guide)."""
    kind: ClusterKind = ClusterKind.ray
    address: str = "auto"
    """The Ray cluster's address (`host:port` of its head's GCS); `auto`: the cluster this machine belongs to."""
    cpus_per_node: Optional[int] = None
    """CPUs each node's task reserves (default: one per process)."""
    gpus_per_node: str = "auto"
    """GPUs each node's task reserves: `auto` (one per process where this machine has GPUs, else none) or a number."""
    resources: Dict[str, float] = field(default_factory=dict)
    """More of Ray's resources each node's task reserves: custom ones the nodes advertise (`ray start --resources`),
    e.g. {accelerator_type:H100: 1}."""
    wait: bool = True
    """Follow the run to its end here; false: return once the run dir is written and the run handed to the cluster
    (a detached Ray actor that places it and restarts it after a lost node); follow it with xtrain.status."""
    kuberay: bool = False
    """With dry_run=true: print KubeRay's RayCluster manifest for a Kubernetes cluster that holds this run (no Ray
    cluster needed), after the plan."""
    min_nodes: Optional[int] = None
    """The fewest nodes the run may continue on after it lost one: it restarts on the live nodes that can hold a
    node's task, at most `nodes`; grad_accum keeps the effective batch. Default: `nodes` again."""
    max_restarts: int = 10
    """Restarts after a lost node the run may have; one more loss ends it `failed`, with its checkpoints, for
    `resume=auto` by hand."""

    NAMES = (ClusterKind.ray,)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_min_nodes(self.min_nodes, self.nodes)
        non_negative("cluster.max_restarts", self.max_restarts)
        if self.cpus_per_node is not None:
            positive("cluster.cpus_per_node", self.cpus_per_node)
        if not (self.gpus_per_node == "auto" or self.gpus_per_node.isdigit()):
            raise ConfigError(f"cluster.gpus_per_node={self.gpus_per_node}: must be a number (0 or more) or auto")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU"):
                raise ConfigError(f"cluster.resources.{name}={amount:g}: set by cluster.{name.lower()}s_per_node; "
                                  f"use that")
            positive(f"cluster.resources.{name}", amount)
        if not self.address or _CONTROL.search(self.address):
            raise ConfigError(f"cluster.address={self.address!r}: give a Ray cluster's host:port, or auto")


def _check_min_nodes(min_nodes: int | None, nodes: int) -> None:
    if min_nodes is not None and not 0 < min_nodes <= nodes:
        raise ConfigError(f"cluster.min_nodes={min_nodes}: must be in [1, cluster.nodes={nodes}]")


OPTIONS: dict[ClusterKind, type[ClusterConfig]] = {ClusterKind.local: LocalConfig, ClusterKind.slurm: SlurmConfig,
                                                   ClusterKind.ray: RayConfig}


_TIME_LIMIT = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_limit_minutes(text: str) -> int:
    """SLURM's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) → whole minutes, at least 1."""
    match = _TIME_LIMIT.fullmatch(text.strip())
    if not match:
        raise ConfigError(
            f"cluster.time_limit={text}: not a SLURM time limit; use MM, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00"
        )
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = int(first), int(second), int(third)
    else:  # MM[:SS]
        hours, minutes, seconds = 0, int(first), int(second or 0)
    total = int(days or 0) * 1440 + hours * 60 + minutes + (seconds + 59) // 60
    if total < 1 or minutes >= 60 and (days is not None or third is not None) or seconds >= 60:
        raise ConfigError(
            f"cluster.time_limit={text}: not a SLURM time limit; use MM, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00"
        )
    return total
