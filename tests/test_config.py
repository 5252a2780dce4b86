"""Config: YAML defaults, flag overrides, and one clear error per mistake."""

import pytest

from common.config import TrainConfig, parse_config
from common.errors import ConfigError


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("local_batch_size: 8\nlr: 1\nmodel: resnet18\n")
    cfg = parse_config(TrainConfig, ["--config", str(path), "--lr", "0.5", "--no-download"])
    assert (cfg.local_batch_size, cfg.lr, cfg.model, cfg.download, cfg.epochs) == (
        8,
        0.5,
        "resnet18",
        False,
        12,
    )
    assert isinstance(cfg.lr, float)


def test_both_flag_spellings():
    assert parse_config(TrainConfig, ["--local_batch_size", "3"]).local_batch_size == 3
    assert parse_config(TrainConfig, ["--local-batch-size", "4"]).local_batch_size == 4


@pytest.mark.parametrize(
    "yaml_text,message",
    [
        ("bach_size: 3\n", "unknown config key 'bach_size'"),
        ("batch_size: 3\n", "'batch_size' in .* is now 'local_batch_size'"),
        ("local_batch_size: '3'\n", "'local_batch_size' must be int, got str"),
        ("local_batch_size: 2.5\n", "'local_batch_size' must be int, got float"),
        ("download: 1\n", "'download' must be bool"),
        ("lr: fast\n", "'lr' must be float"),
        ("local_batch_size: -4\n", "'local_batch_size' must be >= 1"),
        ("dataset: imagenet1k\n", "'dataset' must be one of"),
        ("- a list\n", "must be a mapping"),
        ("local_batch_size: [1\n", "not valid YAML"),
    ],
)
def test_bad_yaml_is_a_config_error_naming_the_key(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse_config(TrainConfig, ["--config", str(path)])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--local-batch-size", "x"], "'local_batch_size' must be int"),
        (["--epochs", "0"], "'epochs' must be >= 1"),
        (["--bogus", "1"], "unrecognized arguments: --bogus"),
        (["--config", "/nonexistent.yaml"], "cannot read config file"),
    ],
)
def test_bad_flags_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(TrainConfig, argv)


def test_example_yaml_files_are_valid(tmp_path):
    from pathlib import Path

    paths = list(Path(__file__).resolve().parents[1].glob("0*/*.yaml"))
    assert paths
    for path in paths:  # keys and types only: the data folder is checked separately
        parse_config(TrainConfig, ["--config", str(path), "--data-dir", str(tmp_path)])
