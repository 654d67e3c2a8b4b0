"""A torchrun worker for tests/test_elastic.py: forms specco's process group (mesh.init_distributed), all-reduces,
and in attempt 0 rank 1 exits (status 43) after the group has formed, as a rank killed mid-run does. In attempt 1
rank 1 comes 3 s late, so rank 0 reads the store before rank 1 has written to it: the keys it finds then are
attempt 0's unless each attempt has its own namespace. Prints "attempt A rank R sum S" once the group works."""
import os
import sys
import time

import torch
import torch.distributed as dist

from specco.faults import KILLED_EXIT
from specco.parallel.mesh import init_distributed

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == int(sys.argv[2]):
    time.sleep(3)
init_distributed("gloo", timeout_s=float(sys.argv[1]))
x = torch.ones(1)
dist.all_reduce(x)
print(f"attempt {attempt} rank {rank} sum {x.item():g}", flush=True)
if attempt == 0 and rank == 1:
    os._exit(KILLED_EXIT)
dist.barrier()  # rank 0 of attempt 0 fails here: its peer is gone
dist.destroy_process_group()
