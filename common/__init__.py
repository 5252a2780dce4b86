"""Thin helpers shared by the examples, only what every script would otherwise copy (the DDP lines stay in them):
    config.py    defaults < YAML < flags; bad input is one `error:` line and exit code 2
    launcher.py  which launcher started this process: rank, world size, where rank 0 listens
    data.py      the data sets (embedded digits by default) and their checks
    models.py    a small CNN and torchvision ResNets
    report.py    summary.json, with every rank's parameter checksum
    errors.py    the bad-input contract shared by the above"""
