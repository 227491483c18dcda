"""cluster=ray on a real Ray cluster of 2 nodes on this machine (tests/ray_cluster.py), in a network namespace of its
own, on loopback only (one cluster for the module's tests; a test that loses a node has one of its own): a 2-node run
follows the local 2-process run and leaves nothing on the cluster; a lost node restarts the run on the node left; a
request the cluster cannot hold, an address where nothing answers and a sweep too wide are refused before anything is
written; sweeps, studies, wait=false and Ctrl-C."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import (PACED, REPO, assert_one_line_error, read_metrics, read_result, run_xtrain,
                      xtrain_in_process)

SMALL = ["trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.log_every=2", "trainer.eval_every=3",
         "trainer.save_every=3"]


# Ray's core notes, in a namespace with no route out, that it found no external address (it then uses 127.0.0.1)
NO_ROUTE = re.compile(r"^\[[^]]+ W \d+ \d+\] network_util\.cc:\d+: Failed to determine local IP")


HARNESS = REPO / "tests" / "ray_cluster.py"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One 2-node cluster of 1 CPU a node for the tests that lose no node, in a network namespace of its own
    (`unshare -n`: Ray binds 127.0.0.1 there): its server's pid (whose namespace the tests' commands enter) and its
    address. Each test asserts the cluster is left as it found it."""
    folder = tmp_path_factory.mktemp("ray")
    serve = [sys.executable, str(HARNESS), "--nodes", "2", "--cpus", "1", "--serve", str(folder / "address")]
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen(["unshare", "-n", "bash", "-c", f"ip link set lo up && exec {shlex.join(serve)}"],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        for _ in range(1200):
            if (folder / "address").exists() or server.poll() is not None:
                break
            time.sleep(0.25)
        assert (folder / "address").exists(), (folder / "server.log").read_text()
        yield server.pid, (folder / "address").read_text()
    finally:
        server.terminate()
        server.wait(timeout=120)


def on_ray(tmp_path: Path, cluster: tuple[int, str] | None, *xtrain_args: str,
           lose_node_when: Path | None = None, interrupt_when: Path | None = None, watch: Path | None = None,
           script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m xtrain cluster=ray ARGS` against `cluster` (the `ray_cluster` fixture's), or else a fresh Ray
    cluster of 2 nodes of 1 CPU each in a network namespace of its own; its stderr (Ray's no-route notes left out) as
    the result's, what the harness says (what was left on the cluster) in stdout. `lose_node_when` (a fresh cluster
    only): a file whose existence makes a node other than the head lost, every process of it killed at once;
    `interrupt_when`: one whose existence sends the command SIGINT; `watch`: a path whose processes left are
    counted. `script`: a bash script to run instead (`{address}` in it: the cluster's)."""
    command = (["bash", "-c", script] if script else
               [sys.executable, "-m", "xtrain", "cluster=ray", "cluster.address={address}", *xtrain_args])
    stderr = tmp_path / "xtrain.stderr"
    options = {"--lose-node-when": lose_node_when, "--interrupt-when": interrupt_when, "--watch": watch}
    options = [arg for option, value in options.items() if value for arg in (option, str(value))]
    assert not (cluster and lose_node_when), "a node is lost from a cluster of the test's own"
    harness = [sys.executable, str(HARNESS), "--stderr", str(stderr), *options]
    if cluster:
        pid, address = cluster
        argv = ["nsenter", f"--net=/proc/{pid}/ns/net", *harness, "--address", address, "--", *command]
    else:
        script = f"ip link set lo up && exec {shlex.join([*harness, '--nodes', '2', '--cpus', '1', '--', *command])}"
        argv = ["unshare", "-n", "bash", "-c", script]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    proc.stdout += proc.stderr  # (the harness's)
    proc.stderr = "".join(line for line in stderr.read_text().splitlines(keepends=True) if not NO_ROUTE.match(line))
    return proc


def curve(run_dir) -> list[tuple]:
    return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in read_metrics(run_dir)
            if "train/loss" in r or "val/loss" in r]


def test_a_2_node_ray_run_follows_the_local_2_process_run_and_leaves_nothing(tmp_path, ray_cluster):
    local = tmp_path / "local"
    run_xtrain(f"run_dir={local}", "cluster.num_processes=2", *SMALL)
    ours = tmp_path / "ray"
    proc = on_ray(tmp_path, ray_cluster, f"run_dir={ours}", "cluster.nodes=2", "cluster.num_processes=1", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ray: 2 node(s) placed; rendezvous 127.0.0.1:" in proc.stderr + proc.stdout
    assert "left: 0 placement group(s), CPUs held 0" in proc.stdout
    result = read_result(ours)
    assert result["status"] == "completed" and result["world_size"] == 2 and result["steps"] == 6
    assert len(list((ours / "logs").glob("launcher-node*.log"))) == 2  # (one torchrun a node)
    got, expected = curve(ours), curve(local)
    assert [row[0] for row in got] == [row[0] for row in expected] and len(got) >= 5
    for (_, loss, val), (_, loss_l, val_l) in zip(got, expected):
        assert loss == pytest.approx(loss_l, rel=1e-6, abs=0) if loss is not None else loss_l is None
        assert val == pytest.approx(val_l, rel=1e-6, abs=0) if val is not None else val_l is None


def test_a_node_lost_mid_run_restarts_on_the_node_left_and_follows_the_unbroken_run(tmp_path):
    """The node other than the head is lost (every process of it killed) once step 4's checkpoint is written: the
    attempt ends, and the run restarts from that checkpoint on the one node left (`cluster.min_nodes=1`), on 1 process
    with grad_accum 2 (the effective batch kept), along the unbroken 2-process run (the same 8 blocks a step; only the
    order of float sums differs). The restart is recorded, the tracker's steps continue, nothing is left."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = [*PACED, "trainer.max_steps=12", "trainer.warmup_steps=2", "trainer.log_every=1", "trainer.eval_every=6",
             "trainer.save_every=4"]
    unbroken, ours = tmp_path / "unbroken", tmp_path / "ray"
    run_xtrain(f"run_dir={unbroken}", "cluster.num_processes=2", *steps)
    proc = on_ray(tmp_path, None, f"run_dir={ours}", "cluster.nodes=2", "cluster.num_processes=1",
                  "cluster.min_nodes=1", "tracker=tensorboard", *steps, lose_node_when=ours / "checkpoints" / "step_00000004" / "xtrain_state.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lost: a node of" in proc.stdout and "left: 0 placement group(s), CPUs held 0" in proc.stdout
    result = read_result(ours)
    assert result["status"] == "completed" and result["world_size"] == 1 and result["steps"] == 12
    [restart] = result["restarts"]
    assert restart["at_step"] == 4 and restart["ended"] == "requeued" and restart["ray_restart_count"] == 1
    assert re.match(r"lost 1 of the run.s 2 node\(s\) \(node [01] on Ray node [0-9a-f]{8}: \w+\)", restart["reason"])
    assert restart["reason"].endswith("; restarted (restart 1 of at most 10)")
    assert restart["moved"] == {"world": [2, 1], "grad_accum": [1, 2]} and 0 < restart["down_s"] < 120
    assert result["steps_lost"] == restart["steps_lost"] >= 0
    assert (ours / "run.yaml").read_text().startswith("# moved to 1 of the run's 2 node(s) (restart 1): grad_accum 1 -> 2\n")
    losses = {r["step"]: r["train/loss"] for r in read_metrics(ours) if "train/loss" in r}
    expected = {r["step"]: r["train/loss"] for r in read_metrics(unbroken) if "train/loss" in r}
    assert sorted(losses) == list(range(1, 13))  # each step once: the lost steps logged again, not twice
    assert {s: losses[s] for s in range(1, 5)} == {s: expected[s] for s in range(1, 5)}
    assert losses == pytest.approx(expected, rel=1e-5, abs=0)
    events = EventAccumulator(str(ours / "tensorboard" / "xtrain"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))


def test_a_node_lost_past_max_restarts_ends_the_run_failed_with_its_checkpoint(tmp_path):
    """cluster.max_restarts=0: the first lost node ends the run `failed`, its error the command's one error line,
    its checkpoint kept for resume=auto by hand, nothing left on the cluster."""
    run_dir = tmp_path / "run"
    proc = on_ray(tmp_path, None, f"run_dir={run_dir}", "cluster.nodes=2", "cluster.num_processes=1",
                  "cluster.max_restarts=0", *PACED, "trainer.max_steps=400", "trainer.save_every=3", "trainer.eval_every=100",
                  lose_node_when=run_dir / "checkpoints" / "step_00000003" / "xtrain_state.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [last] = [line for line in proc.stderr.splitlines() if line.startswith("xtrain: error:")]  # (among Ray's lines)
    assert re.fullmatch(r"xtrain: error: lost 1 of the run's 2 node\(s\) \(.*\); not restarted: the run has been "
                        rf"restarted 0 time\(s\), cluster.max_restarts=0; continue with run_dir={run_dir} resume=auto",
                        last), last
    result = read_result(run_dir)
    assert result["status"] == "failed" and last.endswith(result["error"]) and "restarts" not in result
    assert (run_dir / "checkpoints" / "step_00000003" / "xtrain_state.json").is_file()
    assert "left: 0 placement group(s), CPUs held 0" in proc.stdout


def refused_on_ray(tmp_path: Path, cluster: tuple[int, str], *commands: str) -> list[subprocess.CompletedProcess]:
    """Each bash command (`{address}`: the cluster's) run in turn against `cluster`, each as its own
    process's result (Ray's no-route notes left out of its stderr); the cluster's report of what was left, in the
    last one's stdout."""
    steps = [f"{{ {command}; }} > {tmp_path}/out{i} 2> {tmp_path}/err{i}; echo $? > {tmp_path}/rc{i}"
             for i, command in enumerate(commands)]
    report = on_ray(tmp_path, cluster, script="; ".join(steps))
    procs = [subprocess.CompletedProcess(command, int((tmp_path / f"rc{i}").read_text()),
                                         (tmp_path / f"out{i}").read_text(),
                                         "".join(line for line in (tmp_path / f"err{i}").read_text().splitlines(True)
                                                 if not NO_ROUTE.match(line)))
             for i, command in enumerate(commands)]
    procs[-1].stdout += report.stdout
    return procs


def on_the_cluster(*args: str) -> str:
    return shlex.join([sys.executable, "-m", "xtrain", "cluster=ray", "cluster.address={address}", *args])


def test_what_the_cluster_cannot_hold_or_see_is_refused_before_anything_is_written(tmp_path, ray_cluster):
    """On one 2-node cluster, each refused in one line with nothing written: more nodes than it has; a custom resource
    no node advertises; a sweep of 2 points of 2 nodes at once; a run dir the nodes do not see (xtrain in a mount
    namespace of its own, a tmpfs over the run dir's folder: the nodes see the folder, not what is written there).
    The cluster is left as it was."""
    private = tmp_path / "private"
    private.mkdir()
    unseen = on_the_cluster(f"run_dir={private / 'run'}", "cluster.nodes=2", "cluster.num_processes=1")
    more, special, wide, blind = refused_on_ray(
        tmp_path, ray_cluster,
        on_the_cluster(f"run_dir={tmp_path / 'run'}", "cluster.nodes=3", "cluster.num_processes=1"),
        on_the_cluster(f"run_dir={tmp_path / 'run'}", "cluster.nodes=1", "cluster.num_processes=1",
                       "+cluster.resources.special=1"),
        on_the_cluster("-m", f"hydra.sweep.dir={tmp_path / 'wide'}", "cluster.nodes=2", "cluster.num_processes=1",
                       "hydra.launcher.n_jobs=2", "trainer.lr=1e-3,2e-3"),
        f"unshare -m bash -c {shlex.quote(f'mount -t tmpfs none {private} && exec {unseen}')}")
    assert_one_line_error(more, "cluster.nodes=3: the Ray cluster at", "has 2 of its 2 live node(s) with CPU 1",
                          "cluster.nodes=2")
    assert_one_line_error(special, "cluster.nodes=1: the Ray cluster at",
                          "has 0 of its 2 live node(s) with CPU 1, special 1")
    assert_one_line_error(wide, "hydra.launcher.n_jobs=2: 2 points of 2 node(s) at once need 4 nodes",
                          "has 2 that hold a point's node; use hydra.launcher.n_jobs=1")
    assert_one_line_error(blind, f"run_dir={private / 'run'}: the Ray node(s) at 127.0.0.1 do not see "
                                 f"{private / 'run'} as this machine does",
                          "put the run dir on storage every node mounts at the same path")
    assert not (tmp_path / "run").exists() and not (tmp_path / "wide").exists() and not any(private.iterdir())
    assert "left: 0 placement group(s), CPUs held 0, actors alive 0" in blind.stdout


def test_an_address_where_nothing_answers_is_refused_in_one_line(tmp_path):
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "cluster=ray", "cluster.address=127.0.0.1:1", "cluster.nodes=2",
                      "cluster.num_processes=1", check=False)
    assert_one_line_error(proc, "cluster.address=127.0.0.1:1: no Ray cluster answers at 127.0.0.1:1",
                          "ray start --head")
    assert not (tmp_path / "run").exists()


KUBERAY_SCHEMA = REPO / "tests" / "data" / "kuberay-raycluster-v1.schema.json.gz"  # (README.md there: its source)


def test_a_dry_run_renders_a_raycluster_manifest_that_kuberays_crd_schema_accepts(tmp_path):
    """`dry_run=true cluster.kuberay=true`: no Ray cluster asked; the whole output is YAML (the plan in its comments),
    a RayCluster that KubeRay's own v1 CRD schema accepts, with no field the schema does not know: a worker pod a node
    (min_nodes as minReplicas), a node's CPUs and GPUs, the run dir's folder on every pod."""
    import gzip

    import jsonschema

    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "cluster=ray", "cluster.nodes=2", "cluster.min_nodes=1",
                             "cluster.num_processes=2", "cluster.gpus_per_node=2", "+cluster.resources.special=1",
                             "dry_run=true", "cluster.kuberay=true")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# xtrain plan (dry run") and not (tmp_path / "run").exists()
    manifest = yaml.safe_load(proc.stdout)
    schema = json.loads(gzip.decompress(KUBERAY_SCHEMA.read_bytes()))
    jsonschema.Draft7Validator(kubernetes_schema(schema)).validate(manifest)
    assert unknown_fields(manifest, schema) == []
    [workers] = manifest["spec"]["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (2, 1, 2)
    assert json.loads(workers["rayStartParams"]["resources"]) == {"special": 1}  # (what the nodes advertise)
    [container] = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"cpu": "2", "nvidia.com/gpu": "2"}
    assert container["volumeMounts"] == [{"name": "runs", "mountPath": str(tmp_path)}]
    assert manifest["spec"]["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}
    proc = xtrain_in_process(f"run_dir={tmp_path / 'run'}", "cluster=ray", "cluster.kuberay=true", check=False)
    assert_one_line_error(proc, "cluster.kuberay=true: prints KubeRay's RayCluster manifest for this run under "
                                "dry_run=true and starts nothing")


def kubernetes_schema(node):
    """An OpenAPI schema of Kubernetes as JSON Schema: `x-kubernetes-int-or-string` is an integer or a string."""
    if isinstance(node, dict):
        node = {k: kubernetes_schema(v) for k, v in node.items()}
        if node.get("x-kubernetes-int-or-string"):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return node
    return [kubernetes_schema(v) for v in node] if isinstance(node, list) else node


def unknown_fields(node, schema, path: str = "") -> list[str]:
    """The fields of `node` the schema does not name (Kubernetes drops them, where JSON Schema lets them pass)."""
    if isinstance(node, dict) and "properties" in schema:
        return [found for key, value in node.items() for found in
                ([f"{path}.{key}"] if key not in schema["properties"] else
                 unknown_fields(value, schema["properties"][key], f"{path}.{key}"))]
    if isinstance(node, list) and "items" in schema:
        return [found for i, value in enumerate(node) for found in unknown_fields(value, schema["items"], f"{path}[{i}]")]
    return []


def test_rendezvous_settings_are_refused_under_ray(tmp_path):
    proc = run_xtrain(f"run_dir={tmp_path / 'run'}", "cluster=ray", "cluster.main_process_port=29500", check=False)
    assert_one_line_error(proc, "cluster.main_process_port=29500: Ray places the nodes")


def test_a_sweep_runs_its_points_at_once_as_ray_runs(tmp_path, ray_cluster):
    """Two points of one node each, both at once on the 2-node cluster (hydra.launcher.n_jobs=2): each completes as
    the same run does here."""
    sweep, alone = tmp_path / "sweep", tmp_path / "alone"
    run_xtrain(f"run_dir={alone}", "trainer.lr=2e-3", *SMALL)
    proc = on_ray(tmp_path, ray_cluster, "-m", f"hydra.sweep.dir={sweep}", "cluster.num_processes=1",
                  "hydra.launcher.n_jobs=2", "trainer.lr=1e-3,2e-3", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 points at a time" in proc.stdout + proc.stderr and "left: 0 placement group(s), CPUs held 0" in proc.stdout
    points = sorted(p for p in sweep.iterdir() if (p / "result.json").exists())
    results = [read_result(p) for p in points]
    assert [r["status"] for r in results] == ["completed", "completed"] and len(points) == 2
    first, ends = [r["first_step_at"] for r in results], [(p / "result.json").stat().st_mtime for p in points]
    assert first[0] < ends[1] and first[1] < ends[0]  # (they ran at once)
    [point] = [p for p in points if yaml.safe_load((p / "run.yaml").read_text())["trainer"]["lr"] == 2e-3]
    assert curve(point) == curve(alone)



def test_a_batched_sweep_on_ray_keeps_its_record_and_calls_hydras_callbacks(tmp_path, ray_cluster):
    """Hydra's contract, as on this machine (test_hydra_contract.py): an explicit subdir, `${hydra:job.num}`, one batch
    after another."""
    from hydra_calls import check_jobs, recorded, recording

    sweep, log = tmp_path / "sweep", tmp_path / "calls.jsonl"
    proc = on_ray(tmp_path, ray_cluster, "-m", f"run_dir={sweep}", "cluster.num_processes=1", "hydra/sweeper=basic",
                  "hydra.sweeper.max_batch_size=1", "hydra.sweep.subdir=job${hydra.job.num}",
                  "trainer.seed=${hydra:job.num}", "trainer.lr=0.001,0.002", "trainer.max_steps=4", *SMALL, *recording(log))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_jobs(recorded(log), sweep, ["job0", "job1"], seeds=[0, 1])
    assert [p["overrides"] for p in json.loads((sweep / "sweep.json").read_text())["points"]] == [
        ["trainer.lr=0.001"], ["trainer.lr=0.002"]]


def test_a_study_places_its_trials_across_2_nodes_each_and_prunes_as_here(tmp_path, ray_cluster):
    """A study of 3 trials of 2 nodes each (1 process a node), the median pruner after the first: each trial's run
    spans both nodes, and what Optuna recorded of each is what its run dir says (completed with its value, or pruned
    at a step boundary with a checkpoint)."""
    import optuna

    from xtrain.engine import study_settings

    sweep = tmp_path / "study"
    proc = on_ray(tmp_path, ray_cluster, "-m", f"run_dir={sweep}", "hydra/sweeper=xtrain_optuna",
                  "hydra.sweeper.seed=0", "hydra.sweeper.n_trials=3", "hydra.sweeper.pruner_settings.n_startup_trials=1",
                  "hydra.sweeper.pruner_settings.n_warmup_steps=4", "trainer.lr=tag(log,interval(1e-4,3.0))",
                  "cluster.nodes=2", "cluster.num_processes=1", "trainer.max_steps=12", "trainer.warmup_steps=2",
                  "trainer.log_every=2", "trainer.eval_every=2", "trainer.save_every=2", "trainer.batch_size=4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "left: 0 placement group(s), CPUs held 0" in proc.stdout
    storage = study_settings.open_storage(str(sweep / study_settings.JOURNAL))
    trials = optuna.load_study(study_name=sweep.name, storage=storage).trials
    assert len(trials) == 3
    for entry in json.loads((sweep / "sweep.json").read_text())["points"]:
        result = read_result(sweep / entry["dir"])
        trial = trials[int(entry["dir"].split("_")[0])]
        assert result["world_size"] == 2 and len(set(result["hosts"])) == 1 and len(result["hosts"]) == 2
        assert len(list((sweep / entry["dir"] / "logs").glob("launcher-node*.log"))) == 2  # (one torchrun a node)
        state = {"completed": "COMPLETE", "pruned": "PRUNED", "failed": "FAIL"}[result["status"]]
        assert trial.state.name == state, (trial.state, result.get("error"))
        if state == "COMPLETE":
            assert trial.value == result["val_loss"]
        if state == "PRUNED":
            assert (sweep / entry["dir"] / "checkpoints" / f"step_{result['stop']['step']:08d}").is_dir()
    assert {t.state.name for t in trials} == {"COMPLETE", "PRUNED"}  # (seeded: the first completes, two pruned)


def test_wait_false_hands_the_run_to_the_cluster_and_xtrain_status_follows_it(tmp_path, ray_cluster):
    """cluster.wait=false: the command returns while the run trains (xtrain.status, run at once, shows it unfinished);
    the run completes on the cluster on its own, and then nothing of it is left there, its actor included."""
    run_dir = tmp_path / "run"
    xtrain = shlex.join([sys.executable, "-m", "xtrain", "cluster=ray", "cluster.address={address}", f"run_dir={run_dir}",
                         "cluster.nodes=2", "cluster.num_processes=1", "cluster.wait=false", *PACED,
                         "trainer.max_steps=40", "trainer.eval_every=20", "trainer.save_every=20"])
    status = shlex.join([sys.executable, "-m", "xtrain.status", str(run_dir)])
    result = run_dir / "result.json"
    proc = on_ray(tmp_path, ray_cluster, script=f"{xtrain} && echo HANDED && {status} && for i in $(seq 600); do "
                                   f"grep -q '\"completed\"' {result} 2>/dev/null && break; sleep 0.5; done && "
                                   f"echo FINAL && {status}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "see it with: python -m xtrain.status" in proc.stdout + proc.stderr
    first, final = proc.stdout.split("HANDED", 1)[1].split("FINAL", 1)
    assert re.search(rf"^run {run_dir}: (pending|running), step \d+ of 40$", first, re.M), first  # (at once)
    assert re.search(rf"^run {run_dir}: completed", final, re.M) and read_result(run_dir)["steps"] == 40, final
    assert "left: 0 placement group(s), CPUs held 0, actors alive 0" in proc.stdout, proc.stdout


def test_ctrl_c_cancels_a_ray_run_and_leaves_nothing_running(tmp_path, ray_cluster):
    """SIGINT to the driver while both nodes train: exit 130, the run recorded `interrupted` with its checkpoint
    for resume=auto, no placement group or CPU held, and no process of the run left on any node."""
    run_dir = tmp_path / "run"
    proc = on_ray(tmp_path, ray_cluster, f"run_dir={run_dir}", "cluster.nodes=2", "cluster.num_processes=1", *PACED,
                  "trainer.max_steps=400", "trainer.save_every=3", "trainer.eval_every=100",
                  interrupt_when=run_dir / "checkpoints" / "step_00000003" / "xtrain_state.json", watch=run_dir)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "stopped at once by Ctrl-C; to continue from the newest checkpoint" in proc.stderr
    assert "left: 0 placement group(s), CPUs held 0" in proc.stdout and "processes left: 0" in proc.stdout
    result = read_result(run_dir)
    assert result["status"] == "interrupted" and result["steps"] < 400
