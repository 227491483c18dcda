"""Bad input that reaches xtrain before Hydra does, or whose line must name what the user gave: each one line, exit 2,
saying the right thing."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, refusal, xtrain_in_process
from xtrain.commands import bounds
from xtrain.core.errors import ConfigError

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcde", "bcdef"))  # 10^6 leaves in 200 bytes


def test_a_yaml_bomb_in_a_config_dir_is_refused_before_hydra_reads_it(tmp_path):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "bomb.yaml").write_text(BOMB)
    proc = xtrain_in_process("--config-dir", str(tmp_path / "conf"), f"run_dir={tmp_path / 'run'}", "dry_run=true",
                             check=False)
    assert_one_line_error(proc, f"--config-dir {tmp_path / 'conf'}: {tmp_path / 'conf' / 'experiment' / 'bomb.yaml'} "
                                "expands to more than 100,000 nodes")
    assert not (tmp_path / "run").exists()


def test_a_config_nested_past_what_yaml_reads_is_one_line(tmp_path):
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep.yaml is nested deeper than a config is read"):
        bounds.check_config_dir(str(tmp_path))


def test_expanded_size_counts_aliases_once_per_use_and_stops_at_a_cycle():
    import yaml

    # the mapping, key a and [1, 2] (3 nodes), key b and a list holding [1, 2] twice
    assert bounds.expanded_size(yaml.compose("a: &x [1, 2]\nb: [*x, *x]\n")) == 1 + (1 + 3) + (1 + 1 + 2 * 3)
    assert bounds.expanded_size(yaml.compose(BOMB)) > bounds.NODE_LIMIT
    assert bounds.expanded_size(yaml.compose("&a [*a]")) > bounds.NODE_LIMIT  # an alias to itself: no end
    deep = "[" * 200 + "]" * 200
    assert bounds.expanded_size(yaml.compose(deep)) == 200


@pytest.mark.parametrize("override,expected", [
    ("k" * 5000 + "=1", "kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk...(5000 characters): not a setting (a name of 5000 "
                        "characters); python -m xtrain --cfg job lists every setting"),
    ("model=" + "m" * 300, "model=" + "m" * 40 + "...(300 characters): not an option of model (a name of 300 "
                                                  "characters); python -m xtrain --help lists the options"),
    ("run_dir=runs/" + "r" * 300, "its folder name rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr...(300 characters) is 300 "
                                  "bytes, more than a filesystem takes (255); give a shorter run_dir"),
])
def test_names_longer_than_a_filesystem_takes_are_one_line(override, expected):
    with pytest.raises(ConfigError, match=None) as err:
        bounds.check_override(override)
    assert expected in str(err.value)
    proc = xtrain_in_process(override, "dry_run=true", check=False)
    assert_one_line_error(proc, expected)


def test_a_setting_given_twice_is_refused_quoting_the_value_that_counts():
    assert refusal("trainer.max_steps=5", "trainer.max_steps=x") == "trainer.max_steps=x: not a valid integer"


def test_a_batch_too_large_for_memory_names_the_micro_batch_that_fits():
    line = refusal("trainer.batch_size=1000000000000")
    assert line.startswith("memory: the plan's estimate does not fit this machine")
    assert "trainer.batch_size=1 trainer.grad_accum=1000000000000 would" in line


def test_a_data_file_that_cannot_be_read_is_not_called_binary(tmp_path):
    line = refusal("data=text", "data.files=[/proc/self/mem]")  # (its read fails, even for root: EIO)
    assert line == "data.files: /proc/self/mem cannot be read (Input/output error); fix its permissions or remove it"


def test_a_flag_after_an_override_says_flags_go_first(tmp_path):
    proc = xtrain_in_process("trainer.max_steps=4", "--cfg", "job", f"run_dir={tmp_path / 'run'}", check=False)
    assert_one_line_error(proc, f"unrecognized arguments: run_dir={tmp_path / 'run'}; flags go before the overrides: "
                                "move --cfg (and its value) to the front")


@pytest.mark.parametrize("override,expected", [
    ("trainer.max_steps=٣", "trainer.max_steps=٣: Hydra's override grammar cannot read '٣' (ARABIC-INDIC DIGIT THREE) "
                            "there; write the number with the digits 0-9"),
    ("trainer.max_steps=１", "cannot read '１' (FULLWIDTH DIGIT ONE) there; write the number with the digits 0-9"),
    ("tracker.run_name=a!", "tracker.run_name=a!: Hydra's override grammar cannot read '!' (EXCLAMATION MARK) there; "
                            "quote the value, e.g. tracker.run_name='a!'"),
])
def test_what_hydras_lexer_cannot_read_is_named(tmp_path, override, expected):
    proc = xtrain_in_process(override, f"run_dir={tmp_path / 'run'}", "dry_run=true", check=False)
    assert_one_line_error(proc, expected)


def test_a_point_that_failed_before_its_first_eval_shows_no_val_loss(tmp_path):
    from xtrain.sweeps import summary

    record = {"status": "failed", "steps": 3, "val_loss": 6.9, "val_ppl": 990.0, "initial_val_loss": 6.9,
              "eval_step": 0, "train_loss": 5.0}
    (tmp_path / "result.json").write_text(json.dumps(record))
    row = summary.run_row(tmp_path)
    assert (row["val_loss"], row["val_ppl"], row["train_loss"]) == ("", "", 5.0)
    (tmp_path / "result.json").write_text(json.dumps({**record, "eval_step": 2, "val_loss": 5.5}))
    assert summary.run_row(tmp_path)["val_loss"] == 5.5
