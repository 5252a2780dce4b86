"""05 - turn a training checkpoint into a plain model state_dict for inference.

    python 05_checkpointing/export_model.py runs/latest/checkpoints model.pt
    python 05_checkpointing/export_model.py runs/latest/checkpoints/ckpt-00000090.pt model.pt

The input is a checkpoint folder (its newest valid checkpoint is used), a training checkpoint
file, or a bare state_dict. Keys saved from the DDP wrapper (`model.state_dict()` instead of
`model.module.state_dict()`) carry a `module.` prefix; it is removed, so old checkpoints load too.
The result loads into the plain, unwrapped model with no process group:

    model = build_model("small_cnn", num_classes=10, in_channels=1, image_size=8)
    model.load_state_dict(torch.load("model.pt", weights_only=True))
"""

import argparse
import sys
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import checkpoint as ckpt  # 05_checkpointing/checkpoint.py
from common.errors import ConfigError, DataError
from common.bad_input import exit_on_bad_input
from common.models import build_model


def read_state_dict(source: Path) -> tuple[dict, dict | None]:
    """(model state_dict without `module.`, model_args or
    None) from a folder, checkpoint or state_dict."""
    if source.is_dir():
        path, state = ckpt.find_resumable(
            source, log=lambda line: print(line, file=sys.stderr, flush=True)
        )
        if path is None:
            raise DataError(f"no usable checkpoint in {source}")
        print(f"using {path}")
    else:
        try:
            state = torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise DataError(f"{source}: no such file") from None
        except Exception as exc:
            raise DataError(
                f"{source} cannot be loaded with weights_only=True: "
                f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]}"
            ) from None
    if not isinstance(state, dict):
        raise DataError(f"{source} holds a {type(state).__name__}, not a checkpoint or state_dict")
    model_args = state.get("model_args")
    if isinstance(model_args, list):  # train.py saves build_model's arguments in order
        model_args = dict(zip(("name", "num_classes", "in_channels", "image_size"), model_args))
    weights = (
        dict(state["model"])
        if "model" in state and isinstance(state["model"], dict)
        else dict(state)
    )
    consume_prefix_in_state_dict_if_present(weights, "module.")  # in place: "module.x" -> "x"
    return weights, model_args


def main(argv=None):
    """Bad input (a missing or unusable file, weights that
    do not fit): one `error:` line, exit code 2."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument(
        "source", type=Path, help="checkpoint folder, checkpoint file or state_dict"
    )
    parser.add_argument("output", type=Path, help="where to write the plain state_dict")
    parser.add_argument(
        "--model", default="small_cnn", help="network, if the input does not record it"
    )
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--in-channels", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=8)
    args = parser.parse_args(argv)

    with exit_on_bad_input():
        weights, model_args = read_state_dict(args.source)
        model_args = model_args or dict(
            name=args.model,
            num_classes=args.num_classes,
            in_channels=args.in_channels,
            image_size=args.image_size,
        )
        model = build_model(**model_args)
        try:
            model.load_state_dict(weights)  # strict: every key must match the plain model
        except RuntimeError as exc:
            raise ConfigError(
                f"{args.source} does not fit {model_args}: {str(exc).splitlines()[1].strip()}"
            ) from None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    ckpt.atomic_write(args.output, lambda f: torch.save(model.state_dict(), f))
    print(
        f"wrote {args.output}: {len(weights)} tensors of {model_args['name']}, loadable without DDP"
    )


if __name__ == "__main__":
    main()
