"""Config: dataclass defaults < YAML file (--config) < command-line flags.

Every field of the dataclass is a YAML key and a flag (`batch_size` -> `--batch-size`).
An unknown key, a wrong type or a bad value is a ConfigError naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

from common.errors import ConfigError

C = TypeVar("C")


def _field_type(cls, f: dataclasses.Field) -> tuple[type, bool]:
    """(base type, optional) of a field, resolving string annotations."""
    hint = typing.get_type_hints(cls)[f.name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (base,) = [a for a in args if a is not type(None)]
        return base, True
    return hint, False


def _coerce(key: str, value: Any, base: type, optional: bool) -> Any:
    """Check a YAML or flag value against the field's type; ints are fine where floats are."""
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key '{key}' must be {base.__name__}, got null")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is str:
        if isinstance(value, str):
            return value
    elif base is list:
        if isinstance(value, list):
            return value
    else:
        raise TypeError(f"unsupported config type {base} for {key}")
    raise ConfigError(f"config key '{key}' must be {base.__name__}, got {type(value).__name__} {value!r}")


def _parse_flag(key: str, base: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        if base is str:
            return text
        # YAML rules for one scalar: '3' -> int, '0.1' -> float, 'true' -> bool, '[1,2]' -> list.
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"--{key.replace('_', '-')}: cannot parse {text!r}") from None
        return _coerce(key, value, base, optional)
    return parse


def load_config(cls: type[C], argv: Sequence[str] | None = None, description: str | None = None) -> C:
    """Build `cls` (a dataclass with defaults) from --config YAML and flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types_ = {name: _field_type(cls, f) for name, f in fields.items()}

    parser = _ErrorParser(description=description or cls.__doc__,
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file of defaults (flags override it)")
    for name, f in fields.items():
        base, optional = types_[name]
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if base is bool and name.startswith("no_"):
            # BooleanOptionalAction would make `--no-ddp` mean no_ddp=False: a plain switch instead.
            parser.add_argument(*flags, dest=name, action="store_const", const=True,
                                default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
        elif base is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
        else:
            parser.add_argument(*flags, dest=name, type=_parse_flag(name, base, optional),
                                default=argparse.SUPPRESS, metavar=base.__name__.upper(),
                                help=f"{help_text} (default: {default})")
    args = vars(parser.parse_args(argv))

    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path:
        values.update(_read_yaml(Path(config_path), fields, types_))
    values.update(args)
    try:
        cfg = cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    for name, f in fields.items():
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, name) not in choices:
            raise ConfigError(f"config key '{name}' must be one of {', '.join(map(str, choices))}, "
                              f"got {getattr(cfg, name)!r}")
        minimum = f.metadata.get("min")
        value = getattr(cfg, name)
        if minimum is not None and value is not None and value < minimum:
            raise ConfigError(f"config key '{name}' must be >= {minimum}, got {value}")
    check = getattr(cfg, "validate", None)
    if check:
        check()
    return cfg


def check_data(cfg: "TrainConfig") -> None:
    """Data problems that can be seen before any process group starts: a missing data folder,
    more processes than training samples (for the sets whose size is known without loading;
    the others are checked after loading, in common.data.load_datasets)."""
    from common.data import check_world_size, known_train_size, prepare_command
    from common.errors import DataError, LauncherError
    from common.launcher import detect_launcher

    size = known_train_size(cfg.dataset)
    if size is not None:
        try:
            world_size = detect_launcher(os.environ).world_size
        except LauncherError:
            world_size = 1  # setup_distributed reports the launcher problem itself
        check_world_size(cfg.dataset, size, world_size)
    if cfg.dataset in ("digits", "fake") or (cfg.download and cfg.dataset != "imagefolder"):
        return  # embedded, synthetic, or about to be downloaded
    if not Path(cfg.data_dir).is_dir():
        hint = ("pass --data-dir with train/ and val/ folders" if cfg.dataset == "imagefolder" else
                f"prepare it with `{prepare_command(cfg.dataset, cfg.data_dir)}` or pass --download")
        raise DataError(f"data_dir: folder '{cfg.data_dir}' does not exist ({cfg.dataset}); {hint}")


def _read_yaml(path: Path, fields, types_) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping of keys to values")
    out = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown config key '{key}' in {path} (valid keys: {', '.join(fields)})")
        out[key] = _coerce(key, value, *types_[key])
    return out


class _ErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a ConfigError (one line, exit 2) like a bad YAML key."""

    def error(self, message: str):
        raise ConfigError(message)


def field(default: Any, help: str = "", choices: Sequence[Any] | None = None, min: float | None = None):
    """A config field with its help text and optional allowed values or minimum."""
    meta = {"help": help, "choices": choices, "min": min}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist", "imagefolder", "fake")
MODELS = ("small_cnn", "resnet18", "resnet50")


@dataclasses.dataclass
class TrainConfig:
    """Settings shared by the training examples; an example subclasses it to add its own."""

    dataset: str = field("digits", "data set", choices=DATASETS)
    data_dir: str = field("data", "folder holding downloaded data sets (not used by digits)")
    download: bool = field(False, "download the data set if missing (rank 0 downloads, the others wait)")
    model: str = field("small_cnn", "network", choices=MODELS)
    image_size: int = field(0, "resize images to this size (0: the data set's own size)", min=0)
    epochs: int = field(12, "passes over the training set", min=1)
    max_steps: int = field(0, "stop after this many optimizer steps in total (0: no limit)", min=0)
    batch_size: int = field(32, "samples per rank per step (local batch); global = local x world size", min=1)
    lr: float = field(0.1, "learning rate", min=0.0)
    momentum: float = field(0.9, "SGD momentum", min=0.0)
    weight_decay: float = field(0.0, "SGD weight decay", min=0.0)
    seed: int = field(0, "seed for model init and the sampler's shuffling (same on every rank)", min=0)
    num_workers: int = field(0, "DataLoader worker processes per rank", min=0)
    backend: str = field("auto", "process-group backend", choices=("auto", "gloo", "nccl", "xccl"))
    device: str = field("auto", "device type", choices=("auto", "cpu", "cuda", "xpu"))
    timeout_s: float = field(60.0, "seconds a collective may wait for the other ranks", min=1.0)
    output_dir: str = field("runs/latest", "where summary.json, model.pt and TensorBoard logs go")
    log_every: int = field(10, "print a progress line every N steps", min=1)
    # Performance knobs (see the top-level README, "Performance knobs"); defaults are the plain, safe choice.
    precision: str = field("fp32", "autocast: fp32 (off), bf16, or fp16 (with a GradScaler)",
                           choices=("fp32", "bf16", "fp16"))
    channels_last: bool = field(False, "channels_last memory format for model and inputs")
    compile: bool = field(False, "torch.compile the model (before the DDP wrap)")
    bucket_cap_mb: float = field(25.0, "DDP gradient bucket size in MiB", min=0.0)
    gradient_as_bucket_view: bool = field(False, "DDP: gradients are views into the buckets (saves a copy)")
    static_graph: bool = field(False, "DDP: the graph is the same every step (enables optimizations)")
    find_unused_parameters: bool = field(False, "DDP: allow parameters that get no gradient (costs a graph walk)")
    comm_hook: str = field("none", "DDP communication hook compressing gradients",
                           choices=("none", "bf16_compress", "fp16_compress"))
    no_ddp: bool = field(False, "baseline: same loop without gradient communication (each rank trains alone)")
    pin_memory: bool = field(True, "pinned host memory for faster copies to the GPU (GPU only)")
    persistent_workers: bool = field(True, "keep DataLoader workers alive between epochs (num_workers > 0)")
    prefetch_factor: int = field(2, "batches each DataLoader worker loads ahead (num_workers > 0)", min=1)
    profile_steps: int = field(0, "time this many steps (after profile_warmup) and write the median split of a "
                               "step (data wait, forward+backward, exposed communication, optimizer) into "
                               "summary.json; 0: off", min=0)
    profile_warmup: int = field(5, "steps to leave out before profiling (start-up, first-step allocations)", min=0)

    def validate(self):
        """Called by load_config; a subclass with checks of its own calls super().validate()."""
        check_data(self)
