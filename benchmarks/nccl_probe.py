"""One NCCL all-reduce across the ranks torchrun starts, each on GPU ``LOCAL_RANK % device_count``:
run by benchmarks/gpu_checks.sh to record whether this machine can host a multi-rank NCCL job."""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda") * (rank + 1)
try:
    dist.all_reduce(t)
    print(f"rank {rank}: all_reduce gave {t.tolist()} on {torch.cuda.device_count()} GPU(s), NCCL {torch.cuda.nccl.version()}")
except Exception as e:  # what NCCL says when the job does not fit the machine
    print(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
finally:
    dist.destroy_process_group()
