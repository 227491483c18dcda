"""KubeRay's RayCluster manifest for a `cluster=ray` run (`dry_run=true cluster.kuberay=true`): a Kubernetes cluster
that holds it, one worker pod a node of the run, the run dir's folder on a volume every pod mounts."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from xtrain.config.schema import RunConfig

CLAIM = "xtrain-runs"  # the PersistentVolumeClaim (ReadWriteMany) that holds the run dirs


def ray_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return "2.40.0"


def manifest(cfg: RunConfig, need: dict[str, float]) -> str:
    """The RayCluster as YAML, after comments that say what it holds and how to run on it. `need`: what a node's task
    reserves (`ray_cluster.bundle`)."""
    c = cfg.cluster
    version, gpus = ray_version(), int(need.get("GPU", 0))
    image = f"rayproject/ray:{version}-py{sys.version_info.major}{sys.version_info.minor}{'-gpu' if gpus else ''}"
    folder = str(Path(cfg.run_dir).resolve().parent)
    name = "xtrain-" + (re.sub(r"[^a-z0-9-]+", "-", Path(cfg.run_dir).name.lower()).strip("-")[:40] or "run")
    mounts = [{"name": "runs", "mountPath": folder}]
    volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": CLAIM}}]
    worker = {"cpu": f"{need['CPU']:g}", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    spec = {
        "rayVersion": version,
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "0"},  # (the driver's pod: no node's task is placed on it)
            "template": {"spec": {"containers": [{
                "name": "ray-head", "image": image,
                "resources": {"limits": {"cpu": "2", "memory": "8Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}},
                "ports": [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                          {"containerPort": 10001, "name": "client"}],
                "volumeMounts": mounts}], "volumes": volumes}},
        },
        "workerGroupSpecs": [{
            "groupName": "nodes", "replicas": c.nodes, "minReplicas": c.min_nodes or c.nodes, "maxReplicas": c.nodes,
            "rayStartParams": ({"resources": json.dumps({k: v for k, v in need.items() if k not in ("CPU", "GPU")})}
                               if c.resources else {}),  # (custom resources: what `ray start --resources` takes)
            "template": {"spec": {"containers": [{
                "name": "ray-worker", "image": image, "resources": {"limits": worker, "requests": worker},
                "volumeMounts": mounts}], "volumes": volumes}},
        }],
    }
    document = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name}, "spec": spec}
    header = [
        f"KubeRay RayCluster for this run: {c.nodes} worker pod(s) of {', '.join(f'{k} {v}' for k, v in worker.items())} "
        "(one a node of the run), and a head",
        "pod for xtrain itself. Set each pod's memory (resources: memory) to what the plan above says a node needs.",
        f"The image must have xtrain installed: FROM {image}, then pip install 'xtrain[ray]'.",
        f"The run dir's folder, {folder}, is the PersistentVolumeClaim {CLAIM} (ReadWriteMany) on every pod.",
        "kubectl apply -f THIS_FILE; then, in the head pod (kubectl exec -it HEAD_POD -- bash):",
        f"  python -m xtrain cluster=ray cluster.nodes={c.nodes} cluster.num_processes={c.num_processes} "
        f"run_dir={Path(cfg.run_dir).resolve()} ...",
    ]
    return "".join(f"# {line}\n" for line in header) + yaml.dump(document, Dumper=_Plain, sort_keys=False)


class _Plain(yaml.SafeDumper):
    """YAML without anchors: the head's and the workers' shared volume lists written out at each place."""

    def ignore_aliases(self, data) -> bool:
        return True
