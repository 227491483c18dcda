"""A sweep's summary files, derived from its points' run dirs and nothing else.

`sweep.csv` (one row per point, in point order), `summary.md` (the same table for people, ranked best first by
what the model each point kept scored, the best marked and ties said) and `sweep.png` (val loss curves against
tokens seen, or examples where the task has no token blocks; the final val loss against one swept
setting, or a heatmap over two). Any machine that sees the files can regenerate them at
any time: a running, a killed or a finished sweep alike.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import yaml

from xtrain.config.task import block_tokens, known_direction
from xtrain.core import rundir
from xtrain.parallel import dims
from xtrain.core.files import write_atomic
from xtrain.engine import goodput, study_settings

CSV = "sweep.csv"
MARKDOWN = "summary.md"
PLOT = "sweep.png"
COLUMNS = ["status", "steps", "restarts", "steps_lost", "train_loss", "val_loss", "val_ppl", "tokens_per_s", "batch_sequences",
           "batch_tokens", "world_size", "wall_time_s", "goodput", "peak_rss_mb", "peak_device_mb", "error"]


def swept_keys(entries: list[dict]) -> list[str]:
    keys: list[str] = []
    for entry in entries:
        for override in entry["overrides"]:
            key = override.partition("=")[0]
            if key not in keys:
                keys.append(key)
    return keys


def run_config(path: Path) -> dict:
    """run.yaml as plain data (empty before it is written): a summary reads many, typed loading is slow."""
    file = path / rundir.RUN_CONFIG
    if not file.exists():
        return {}
    try:
        loaded = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise rundir.unreadable(file, err) from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("trainer"), dict):
        raise rundir.unreadable(file, "not a run config")
    return loaded


def latest_train_row(path: Path) -> tuple:
    """(step, train loss) of the newest training row in metrics.jsonl; ("", "") before the first."""
    try:
        lines = (path / rundir.METRICS).read_text().splitlines()
    except FileNotFoundError:
        return "", ""
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "train/loss" in row:
            return row["step"], row["train/loss"]
    return "", ""


def run_row(path: Path, objective: str | None = None) -> dict:
    """One run dir's figures (status `pending` where it has not started, `lost` where its process is gone without
    recording an end). `objective`: also the step of the model in `model/` and the value it scored
    (`model_<objective>`), which ranks the run."""
    result = rundir.read_result(path)
    cfg = run_config(path)
    row = {column: result.get(column, "") for column in COLUMNS}
    row["status"] = rundir.shown_status(path)
    row["restarts"] = len(result.get("restarts", []))  # resumed in its own run dir: requeues, resume=auto
    row["steps_lost"] = result.get("steps_lost", 0)
    for column, key in (("peak_rss_mb", "peak_rss_bytes"), ("peak_device_mb", "peak_device_memory_bytes")):
        every_rank = result.get(key) or []  # the largest rank's
        row[column] = round(max(every_rank) / 2**20) if every_rank else ""
    if row["status"] in (rundir.Status.running, rundir.LOST):  # its progress so far (as far as it was logged)
        row["steps"], row["train_loss"] = latest_train_row(path)
    if cfg:
        world = cfg["cluster"]["nodes"] * int(cfg["cluster"]["num_processes"])
        sequences = dims.recorded_effective_batch(cfg)
        block = block_tokens(cfg.get("task", {}).get("name", "causal_lm"), cfg["data"])
        row.update(batch_sequences=sequences, batch_tokens=sequences * block if block else "",
                   world_size=result.get("world_size", world))
    row.update({key: value for key, value in result.items()  # a task's own: val_<metric>, examples_per_s
                if (key.startswith("val_") or key.endswith("_per_s")) and key not in row})
    if result.get("eval_step") == 0 and (result.get("steps") or 0) > 0:  # only the untrained model's eval: not its own
        row.update({key: "" for key in row if key.startswith("val_")})
    if objective is not None:
        kept = rundir.kept_value(result, objective)
        row.update(model_step=result.get("model_step", ""), **{f"model_{objective}": "" if kept is None else kept})
    return row


def rows(sweep_dir: Path) -> list[dict]:
    entries = rundir.sweep_points(sweep_dir)
    keys = swept_keys(entries)
    objective, _ = ranking(sweep_dir)
    out = []
    for entry in entries:
        values = dict(o.partition("=")[::2] for o in entry["overrides"])
        out.append({"point": entry["dir"], **{k: values.get(k, "") for k in keys},
                    **run_row(Path(sweep_dir) / entry["dir"], objective)})
    columns = list(dict.fromkeys(key for row in out for key in row))  # a pending point lacks its task's values
    columns = [key for key in columns if key not in LANGUAGE_MODEL_ONLY or any(row.get(key, "") != "" for row in out)]
    return [{key: row.get(key, "") for key in columns} for row in out]


LANGUAGE_MODEL_ONLY = ("val_ppl", "tokens_per_s", "batch_tokens")  # (columns a classifier's points leave empty)


def ranked(table: list[dict], objective: str, direction: str) -> list[dict]:
    """The points best first (by what the model each kept scored), then those with no score, in point order."""
    done = [r for r in table if isinstance(scored(r, objective), float) and math.isfinite(scored(r, objective))]
    done.sort(key=lambda r: scored(r, objective), reverse=direction == "maximize")  # (stable: ties in point order)
    return done + [r for r in table if r not in done]


def ties(table: list[dict], top: dict, objective: str) -> list[str]:
    """The points that scored what the best scored."""
    return [r["point"] for r in table if r is not top and r["status"] == "completed"
            and scored(r, objective) == scored(top, objective)]


def study_record(sweep_dir: Path) -> dict:
    """A study's study.json (study.py), or {} for a grid sweep."""
    path = Path(sweep_dir) / study_settings.STUDY_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def ranking(sweep_dir: Path) -> tuple[str, str]:
    """(value, direction) that ranks the points: a study's objective; else the points' `trainer.monitor`, in the
    direction their runs judged it (result.json's `monitor`)."""
    record = study_record(sweep_dir)
    if record:
        return record.get("objective", "val_loss"), record.get("direction", "minimize")
    for entry in rundir.sweep_points(sweep_dir):
        monitor = rundir.read_result(Path(sweep_dir) / entry["dir"]).get("monitor")
        if monitor:
            return monitor["name"], monitor["direction"]
    for entry in rundir.sweep_points(sweep_dir):
        trainer = run_config(Path(sweep_dir) / entry["dir"]).get("trainer")
        if trainer:
            name, direction = trainer.get("monitor", "val_loss"), trainer.get("monitor_direction", "auto")
            return name, direction if direction != "auto" else known_direction(name) or "minimize"
    return "val_loss", "minimize"


def throughput_column(table: list[dict]) -> str:
    """`tokens_per_s` or the task's own unit (`examples_per_s`), as the points recorded it."""
    found = [key for row in table for key, value in row.items() if key.endswith("_per_s") and value != ""]
    return found[0] if found else "tokens_per_s"


def scored(row: dict, objective: str):
    """The value that ranks a point: what the model it kept scored (`model_<objective>`), else its last value."""
    kept = row.get(f"model_{objective}", "")
    return kept if kept != "" else row.get(objective)


def best(table: list[dict], objective: str = "val_loss", direction: str = "minimize") -> dict | None:
    done = [r for r in table if r["status"] == "completed" and isinstance(scored(r, objective), float)
            and math.isfinite(scored(r, objective))]
    pick = max if direction == "maximize" else min
    return pick(done, key=lambda r: scored(r, objective)) if done else None


def fmt(value) -> str:
    """Losses to 4 decimals, ppl and seconds to 2, throughput whole; at least 3 significant digits (3e-05, not
    0.0000)."""
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        text = f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
        significant = text.lstrip("-0.").replace(".", "")
        return text if len(significant) >= 3 or abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def markdown(sweep_dir: Path, table: list[dict]) -> str:
    record = study_record(sweep_dir)
    objective, direction = ranking(sweep_dir)
    top = best(table, objective, direction)
    counts: dict[str, int] = {}
    for r in table:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    kind = f"Study {record['study_name']}:" if record else "Sweep"
    lines = [f"# {kind} {Path(sweep_dir).resolve()}", "",
             f"{len(table)} points: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())), ""]
    if record:
        lines += [f"{record['n_trials']} trials; {direction} {objective}; sampler "
                  f"{record['sampler']['_target_'].split('.')[-1]}, pruner {record['pruner']}; storage "
                  f"{record['storage']}", ""]
    if top:
        lowest = "highest" if direction == "maximize" else "lowest"
        step = f" (its model/, step {top['model_step']})" if top.get("model_step", "") != "" else ""
        tied = ties(table, top, objective)
        tie = f"; tied with {', '.join(tied)}" if tied else ""
        lines += [f"Best ({lowest} {objective}): **{top['point']}**, {objective} {fmt(scored(top, objective))}{step}"
                  f"{tie}", "", f"Points ranked by {objective}, best first:", ""]
    total = goodput_total(sweep_dir, table)
    if total:
        lines += [total, ""]
    pictures = [name for name in [PLOT, *study_settings.PLOTS] if (Path(sweep_dir) / name).exists()]
    if record and pictures:
        lines += ["Pictures: " + ", ".join(f"[{name}]({name})" for name in pictures), ""]
    header = list(table[0]) if table else ["point"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for r in ranked(table, objective, direction):
        cells = [fmt(r[h]).replace("|", "/") for h in header]
        if r is top:
            cells[0] = f"**{cells[0]}** (best)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def goodput_total(sweep_dir: Path, table: list[dict]) -> str:
    """`Goodput 64% of the points' 41m20s: startup 21%, evals 9%, ...`: every point's parts summed, over their spans
    summed (the points' own time; not the sweep's, whose points may run at once)."""
    parts: dict[str, float] = {}
    for row in table:
        for name, seconds in (rundir.read_result(Path(sweep_dir) / row["point"]).get("goodput_breakdown") or {}).items():
            parts[name] = parts.get(name, 0.0) + seconds
    span = sum(parts.values())
    if not span:
        return ""
    rest = goodput.shown(parts, span)
    return (f"Goodput {parts.get('training_s', 0.0) / span:.0%} of the points' {goodput.duration(span)}"
            + (f": {rest}" if rest else ""))


def write(sweep_dir: Path, picture: bool = True) -> list[dict]:
    """Regenerate sweep.csv, summary.md and (`picture`) sweep.png; returns the table."""
    sweep_dir = Path(sweep_dir)
    table = rows(sweep_dir)
    buffer = io.StringIO()
    if table:
        writer = csv.DictWriter(buffer, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    write_atomic(sweep_dir / CSV, buffer.getvalue())
    write_atomic(sweep_dir / MARKDOWN, markdown(sweep_dir, table))
    if picture:
        plot(sweep_dir, table)
    return table


def _val_curve(path: Path, per_step: int) -> tuple[list[float], list[float]]:
    """Val loss against what was seen (`per_step` tokens or examples per optimizer step)."""
    metrics = path / rundir.METRICS
    if not per_step or not metrics.exists():
        return [], []
    xs, ys = [], []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "val/loss" in row and math.isfinite(row["val/loss"]):
            xs.append(row["step"] * per_step)
            ys.append(row["val/loss"])
    return xs, ys


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def plot(sweep_dir: Path, table: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rundir.sweep_points(sweep_dir))
    grid = 0 < len(keys) <= 2 and not study_record(sweep_dir)  # a study's sampled values make no grid: Optuna draws it
    fig, axes = plt.subplots(1, 2 if grid else 1, figsize=(13 if grid else 7, 4.8), squeeze=False)
    curves = axes[0][0]
    tokens = all(r.get("batch_tokens", "") != "" for r in table if r.get("batch_sequences", "") != "")  # else examples
    for r in table:
        xs, ys = _val_curve(Path(sweep_dir) / r["point"], r.get("batch_tokens" if tokens else "batch_sequences", ""))
        if xs:
            label = " ".join(f"{k.split('.')[-1]}={r[k]}" for k in keys) or r["point"]
            curves.plot(xs, ys, marker="o", markersize=3, label=f"{label} ({r['status']})")
    curves.set(xlabel="tokens seen" if tokens else "examples seen", ylabel="val loss", title="validation loss")
    curves.grid(alpha=0.3)
    if curves.lines:
        curves.legend(fontsize=8)
    if grid:
        finals = {tuple(r[k] for k in keys): r["val_loss"] for r in table if isinstance(r["val_loss"], float)}
        _final_panel(axes[0][1], keys, table, finals)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    write_atomic(Path(sweep_dir) / PLOT, buffer.getvalue())


def _ordered(values: list[str]) -> list[str]:
    unique = list(dict.fromkeys(values))
    numbers = [_number(v) for v in unique]
    return sorted(unique, key=_number) if all(n is not None for n in numbers) else unique


def _final_panel(ax, keys: list[str], table: list[dict], finals: dict) -> None:
    """Final val loss against one swept setting (a line), or over two (a heatmap)."""
    first = _ordered([r[keys[0]] for r in table])
    if len(keys) == 1:
        xs = [v for v in first if (v,) in finals]
        numeric = all(_number(v) is not None for v in xs)
        ax.plot([_number(v) for v in xs] if numeric else xs, [finals[(v,)] for v in xs], marker="o")
        ax.set(xlabel=keys[0], ylabel="final val loss", title=f"final val loss by {keys[0]}")
        ax.grid(alpha=0.3)
        return
    second = _ordered([r[keys[1]] for r in table])
    grid = [[finals.get((a, b), math.nan) for b in second] for a in first]
    image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(len(second)), second)
    ax.set_yticks(range(len(first)), first)
    ax.set(xlabel=keys[1], ylabel=keys[0], title="final val loss")
    done = [v for line in grid for v in line if not math.isnan(v)]
    middle = (min(done) + max(done)) / 2 if done else 0.0
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            color = "red" if math.isnan(value) else ("black" if value < middle else "white")  # on yellow, on purple
            ax.text(j, i, "no result" if math.isnan(value) else f"{value:.3f}", ha="center", va="center",
                    color=color, fontsize=9)
    ax.figure.colorbar(image, ax=ax)
