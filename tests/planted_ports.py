"""The doctor's planted mistakes that are a few lines of a correct port.

Each is tests/doctor_corpus/correct_port.py with the edits below, written out by `write()`. The
mistakes that need a script of their own (helpers, loader workers) are whole files in
tests/doctor_corpus/. In both, the mistake's line carries `# planted: KIND`, the kind the doctor
must name at that line.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).parent / "doctor_corpus"
CORRECT_PORT = CORPUS / "correct_port.py"
NO_SET_EPOCH = ("        sampler.set_epoch(epoch)\n", "")
SAVE = "    if rank == 0:\n        torch.save("

# name: (what is planted, the docstring; [(text of the correct port, what replaces it), ...])
EDITS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "data_parallel": (
        "nn.DataParallel inside a DDP script.",
        [("DDP(model)", "DDP(nn.DataParallel(model))  # planted: data-parallel")],
    ),
    "ddp_forward_on_rank_0": (
        "the DDP model evaluated on rank 0 alone; its forward broadcasts BatchNorm's buffers.",
        [
            ("nn.ReLU(), nn.Dropout(args.dropout)", "nn.BatchNorm1d(16), nn.ReLU()"),
            (
                "    if rank == 0:\n",
                "    if rank == 0:\n"
                "        model.eval()\n"
                "        with torch.no_grad():\n"
                "            logits = model(dataset.tensors[0])"
                "  # planted: ddp-forward-in-rank-branch\n"
                '        print(f"mean prediction {logits.argmax(1).float().mean():.2f}")\n',
            ),
        ],
    ),
    "sharded_forward_on_rank_0": (
        "a model sharded by FSDP2 evaluated on rank 0 alone; its forward all-gathers parameters.",
        [
            (
                "from torch.nn.parallel import DistributedDataParallel as DDP\n",
                "from torch.distributed.checkpoint.state_dict import (\n"
                "    StateDictOptions,\n"
                "    get_model_state_dict,\n"
                ")\n"
                "from torch.distributed.fsdp import fully_shard\n",
            ),
            ("    model = DDP(model)\n", "    fully_shard(model)\n"),
            (
                '    if rank == 0:\n        torch.save(model.module.state_dict(), "model.pt")',
                "    options = StateDictOptions(full_state_dict=True, cpu_offload=True)\n"
                "    state = get_model_state_dict(model, options=options)\n"
                "    if rank == 0:\n"
                "        with torch.no_grad():\n"
                "            logits = model(dataset.tensors[0])"
                "  # planted: ddp-forward-in-rank-branch\n"
                '        print(f"mean prediction {logits.argmax(1).float().mean():.2f}")\n'
                '        torch.save(state, "model.pt")',
            ),
        ],
    ),
    "every_rank_saves": (
        "every rank saves the model to the same file.",
        [
            (
                '    if rank == 0:\n        torch.save(model.module.state_dict(), "model.pt")',
                '    torch.save(model.module.state_dict(), "model.pt")'
                "  # planted: every-rank-writes",
            )
        ],
    ),
    "forward_through_module": (
        "the training forward goes through model.module, around DDP.",
        [("model(inputs), labels)", "model.module(inputs), labels)  # planted: forward-skips-ddp")],
    ),
    "gpu_zero": (
        ".cuda() without an index and no torch.cuda.set_device (GPU only: lint).",
        [
            ('"gloo"', '"nccl"'),
            ("DDP(model)", "DDP(model.cuda())  # planted: every-rank-on-gpu-0"),
            (
                "            loss = F.cross_entropy(model(inputs), labels)",
                "            inputs = inputs.cuda()  # planted: every-rank-on-gpu-0\n"
                "            loss = F.cross_entropy(model(inputs), labels.to(inputs.device))",
            ),
        ],
    ),
    "mean_over_whole_dataset": (
        "test() divides this rank's sum over its shard by the whole test set's size.",
        [
            (
                "\n\ndef main():",
                "\n\n@torch.no_grad()\n"
                "def test(model, test_loader):\n"
                "    test_loss = 0.0\n"
                "    for inputs, labels in test_loader:\n"
                "        test_loss += F.cross_entropy(model(inputs), labels, "
                'reduction="sum").item()\n'
                "    test_loss /= len(test_loader.dataset)  # planted: mean-over-whole-dataset\n"
                '    print(f"test loss {test_loss:.4f}")\n'
                "\n\ndef main():",
            ),
            (
                "sampler=sampler)\n",
                "sampler=sampler)\n"
                "    test_set = make_data(32)\n"
                "    test_loader = DataLoader(\n"
                "        test_set, batch_size=args.batch_size, "
                "sampler=DistributedSampler(test_set, shuffle=False)\n"
                "    )\n",
            ),
            (
                "                break\n",
                "                break\n        test(model, test_loader)\n",
            ),
        ],
    ),
    "model_before_seed": (
        "the model is built before torch.manual_seed.",
        [
            (
                "    torch.manual_seed(0)\n"
                "    model = nn.Sequential(nn.Linear(8, 16), "
                "nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(16, 2))\n",
                "    layers = [nn.Linear(8, 16), "
                "nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(16, 2)]\n"
                "    model = nn.Sequential(*layers)  # planted: model-before-seed\n"
                "    torch.manual_seed(0)\n",
            )
        ],
    ),
    "no_destroy": (
        "no dist.destroy_process_group() at the end.",
        [
            ('("gloo")', '("gloo")  # planted: no-destroy'),
            ("    del model\n    dist.destroy_process_group()\n", ""),
        ],
    ),
    "no_sampler": (
        "the training loader has no DistributedSampler.",
        [
            ("DistributedSampler, TensorDataset", "TensorDataset"),
            (
                "    sampler = DistributedSampler(dataset, num_replicas=world_size, "
                "rank=rank, seed=0)\n"
                "    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)\n",
                "    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)"
                "  # planted: no-sampler\n",
            ),
            NO_SET_EPOCH,
        ],
    ),
    "no_set_epoch": (
        "no sampler.set_epoch(epoch), so every epoch repeats the first's order.",
        [
            (
                "DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)",
                "DistributedSampler(dataset, world_size, rank, seed=0)  # planted: no-set-epoch",
            ),
            NO_SET_EPOCH,
        ],
    ),
    "rank0_break": (
        "the dry run's break sits in rank 0's logging branch: only rank 0 leaves the loop.",
        [
            (
                "            if args.dry_run:\n                break\n",
                "                if args.dry_run:\n                    break"
                "  # planted: rank-control-flow\n",
            )
        ],
    ),
    "shuffle_and_sampler": (
        "shuffle=True beside the sampler (DataLoader refuses it).",
        [
            (
                "    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)\n",
                "    loader = DataLoader(  # planted: shuffle-and-sampler\n"
                "        dataset, batch_size=args.batch_size, sampler=sampler, shuffle=True\n"
                "    )\n",
            )
        ],
    ),
    "unsharded_sampler": (
        "a RandomSampler, which hands every rank the whole data set.",
        [
            ("DistributedSampler, TensorDataset", "RandomSampler, TensorDataset"),
            (
                "DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)",
                "RandomSampler(dataset)",
            ),
            (
                "DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)",
                "DataLoader(dataset, args.batch_size, sampler=sampler)"
                "  # planted: unsharded-sampler",
            ),
            NO_SET_EPOCH,
        ],
    ),
    # Correct twins of patterns public scripts have, which lint once took for mistakes, and the
    # planted mistake each stands beside.
    "barrier_on_rank_0": (
        "a barrier that rank 0 alone calls.",
        [
            (
                SAVE,
                "    if rank == 0:\n        dist.barrier()  # planted: collective-in-rank-branch\n"
                "        torch.save(",
            )
        ],
    ),
    "ddp_flag_branch": (
        "a barrier under `ddp = RANK != -1`, true on every rank of a DDP run.",
        [
            (
                SAVE,
                '    ddp = int(os.environ.get("RANK", -1)) != -1\n    if ddp:\n'
                "        dist.barrier()\n" + SAVE,
            )
        ],
    ),
    "paired_barriers": (
        "torch_distributed_zero_first: the other ranks wait before the data, rank 0 after it.",
        [
            (
                "    dataset = make_data(96)\n",
                "    if rank != 0:\n        dist.barrier()\n    dataset = make_data(96)\n"
                "    if rank == 0:\n        dist.barrier()\n",
            )
        ],
    ),
    "method_named_like_a_function": (
        "rank 0 calls hooks.sync(), a method that prints; the module's sync() is a barrier.",
        [
            (
                "\n\ndef main():\n",
                '\n\nclass Hooks:\n    def sync(self):\n        print("synced", flush=True)\n\n\n'
                "def sync():\n    dist.barrier()\n\n\ndef main():\n",
            ),
            (
                SAVE,
                "    sync()\n    hooks = Hooks()\n    if rank == 0:\n        hooks.sync()\n"
                "        torch.save(",
            ),
        ],
    ),
    "data_parallel_without_ddp": (
        "nn.DataParallel in the branch that runs without a process group, beside the DDP wrap.",
        [
            (
                "    model = DDP(model)\n",
                "    if world_size > 1:\n        model = DDP(model)\n"
                "    elif torch.cuda.device_count() > 1:\n        model = nn.DataParallel(model)\n",
            )
        ],
    ),
}

NAMES = sorted([path.stem for path in CORPUS.glob("*.py")] + list(EDITS))


def write(name: str, folder: Path) -> Path:
    """The script `name` as a file in `folder`: a whole corpus file, or the port with its edits."""
    if name not in EDITS:
        return CORPUS / f"{name}.py"
    planted, edits = EDITS[name]
    lines = CORRECT_PORT.read_text().split("\n", 1)
    what = "Planted" if any("# planted:" in new for _, new in edits) else "Correct"
    text = f'"""{what}: {planted}"""\n' + lines[1]
    for old, new in edits:
        assert text.count(old) == 1, f"{name}: {old!r} is not once in {CORRECT_PORT.name}"
        text = text.replace(old, new)
    path = folder / f"{name}.py"
    path.write_text(text)
    return path
