"""The one result writer of the benches that save to bench/results/<name>_<device>.json: the run's metadata
(device, torch, date, command) first, then the bench's own fields."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def write_results(fields: dict, name: str, device: torch.device, out: str | None = None) -> Path:
    """Write {device, torch, date, command, **fields} to `out` (default bench/results/<name>_<device type>.json)."""
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv), **fields}
    path = Path(out or Path(__file__).parent / "results" / f"{name}_{device.type}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return path
