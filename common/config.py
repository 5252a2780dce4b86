"""Config: dataclass defaults < YAML file (--config) < flags; every field is a
YAML key and a flag (`local_batch_size` -> `--local-batch-size`). An unknown key, a wrong
type or a bad value is one `error:` line and exit code 2, as with argparse."""

# keep annotations strings: a docstring-less subclass's --help shows its signature
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Sequence, TypeVar, get_type_hints

import yaml

from common.errors import ConfigError
from common.bad_input import exit_on_bad_input

C = TypeVar("C")
# Keys renamed since an earlier release, old: new. The old name is refused with one line that names
# the new one, not taken as an alias: a job file or YAML file written for the old name stops at
# once, before any process group, and the settings keep one name each (`batch_size` did not say
# whether it was per rank or for the whole job).
RENAMED = {"batch_size": "local_batch_size"}
DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist", "imagefolder", "fake")
MODELS = ("small_cnn", "resnet18", "resnet50")


def field(
    default: Any, help: str = "", choices: Sequence[Any] | None = None, min: float | None = None
):
    """A config field with its help text and optional allowed values or minimum."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "min": min}
    )


@dataclasses.dataclass
class TrainConfig:
    """Settings shared by the training examples; an example subclasses it to add its own."""

    dataset: str = field("digits", "data set", choices=DATASETS)
    data_dir: str = field("data", "folder holding downloaded data sets (not used by digits)")
    download: bool = field(
        False, "download the data set if missing (rank 0 downloads, the others wait)"
    )
    model: str = field("small_cnn", "network", choices=MODELS)
    image_size: int = field(0, "resize images to this size (0: the data set's own size)", min=0)
    epochs: int = field(12, "passes over the training set", min=1)
    max_steps: int = field(0, "stop after this many optimizer steps in total (0: no limit)", min=0)
    local_batch_size: int = field(
        32, "samples per rank per step (local batch); global = local x world size", min=1
    )
    lr: float = field(0.1, "learning rate", min=0.0)
    momentum: float = field(0.9, "SGD momentum", min=0.0)
    weight_decay: float = field(0.0, "SGD weight decay", min=0.0)
    seed: int = field(
        0,
        "init and shuffle seed (same on every rank); augmentation, loader workers: seed + rank",
        min=0,
    )
    num_workers: int = field(0, "DataLoader worker processes per rank", min=0)
    timeout_s: float = field(60.0, "seconds a collective may wait for the other ranks", min=1.0)
    output_dir: str = field("runs/latest", "where summary.json and model.pt go")
    log_every: int = field(10, "print a progress line every N steps", min=1)


def _check_type(key: str, value: Any, kind: type) -> Any:
    # an int does for a float
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # a bool is no number here
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"config key '{key}' must be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _flag_parser(key: str, kind: type):
    def parse(text: str):
        try:  # YAML rules for one scalar: '3' -> int, '0.1' -> float
            return _check_type(key, yaml.safe_load(text), kind)
        except yaml.YAMLError:
            raise ConfigError(f"--{key.replace('_', '-')}: cannot parse {text!r}") from None

    return parse


class _Renamed(argparse.Action):  # an old flag: refused, its message (const) naming the new one
    def __call__(self, parser, namespace, values, option_string=None):
        raise ConfigError(f"{option_string} is now {self.const}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a bad flag is a ConfigError, like a bad YAML key
        raise ConfigError(message)


def load_config(cls: type[C], argv: Sequence[str] | None = None) -> C:
    """Build `cls` (a dataclass with defaults) from --config
    YAML and flags; bad input exits with code 2."""
    with exit_on_bad_input():
        return parse_config(cls, argv)


def parse_config(cls: type[C], argv: Sequence[str] | None = None) -> C:
    """load_config without the exit: raises ConfigError."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kinds = get_type_hints(cls)
    parser = _Parser(
        description=cls.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", help="YAML file of defaults (flags override it)")
    for name, f in fields.items():
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        kind = kinds[name]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:  # --flag / --no-flag
            how = dict(action=argparse.BooleanOptionalAction)
        else:  # a string as typed, anything else by YAML's rules
            how = dict(
                type=str if kind is str else _flag_parser(name, kind), metavar=kind.__name__.upper()
            )
        parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=help_text, **how)
    for old, new in RENAMED.items():
        if new in fields:
            renamed = f"--{new.replace('_', '-')}: {fields[new].metadata['help']}"
            flags = [f"--{old.replace('_', '-')}", f"--{old}"]
            parser.add_argument(
                *flags,
                nargs="?",
                action=_Renamed,
                const=renamed,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    # torch.distributed.launch's
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = vars(parser.parse_args(argv))
    # the local rank is read from LOCAL_RANK (launcher.py)
    config = args.pop("config")
    args.pop("local_rank")
    values = _read_yaml(Path(config), fields, kinds) if config else {}
    cfg = cls(**{**values, **args})  # flags override the YAML file
    for name, f in fields.items():
        value = getattr(cfg, name)
        choices = f.metadata.get("choices")
        minimum = f.metadata.get("min")
        if choices and value not in choices:
            raise ConfigError(
                f"config key '{name}' must be one of {', '.join(map(str, choices))}, got {value!r}"
            )
        if minimum is not None and value < minimum:
            raise ConfigError(f"config key '{name}' must be >= {minimum}, got {value}")
    if hasattr(cfg, "validate"):  # checks of a subclass that involve several keys
        cfg.validate()
    return cfg


def _read_yaml(path: Path, fields, kinds) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping of keys to values")
    if renamed := [key for key in raw if RENAMED.get(key) in fields]:
        new = RENAMED[renamed[0]]
        raise ConfigError(
            f"config key '{renamed[0]}' in {path} is now '{new}': {fields[new].metadata['help']}"
        )
    if unknown := [key for key in raw if key not in fields]:
        raise ConfigError(
            f"unknown config key '{unknown[0]}' in {path} (valid keys: {', '.join(fields)})"
        )
    return {key: _check_type(key, value, kinds[key]) for key, value in raw.items()}
