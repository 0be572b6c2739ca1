"""A small deterministic PyTorch training loop, for checking a training job through a
checkpoint and a failover: its whole output must be byte-identical to an uninterrupted run.

    python3 tests/gpu/train.py [--steps 300] [--workers 2] [--mp-context fork] [--device cuda]

An MLP on synthetic data (a seeded generator), through a DataLoader with worker processes,
with Adam. Each step prints the step, the loss and a checksum of the weights as exact hex
floats; the last line is the sha256 of every parameter's bytes. Deterministic algorithms are
required (CUBLAS_WORKSPACE_CONFIG is set before CUDA starts), so two runs on the same GPU agree
bit for bit, and any lost, repeated or corrupted step after a restore shows in the output.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Synthetic(Dataset):
    """Sample i is a function of i alone: the same in any worker, in any run."""

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(self.dim, generator=g)
        y = (x[: self.dim // 2].sum() - x[self.dim // 2 :].sum()).tanh().unsqueeze(0)
        return x, y


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mp-context", default=None, help="the workers' start method (fork, spawn, forkserver)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--step-s", type=float, default=0.05, help="sleep after each step (a longer run)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--width", type=int, default=2048)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    dev = torch.device(args.device)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.dim, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, 1),
    ).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = Synthetic(args.steps * 64, args.dim)
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(7), persistent_workers=args.workers > 0,
                        multiprocessing_context=args.mp_context if args.workers > 0 else None)
    print(f"train: {sum(q.numel() for q in model.parameters())} parameters on {dev}, "
          f"{args.workers} workers, {args.steps} steps", flush=True)
    for step, (x, y) in enumerate(loader, 1):
        x, y = x.to(dev), y.to(dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = sum(q.double().sum() for q in model.parameters()).item()
        print(f"{step} {loss.item().hex()} {total.hex()}", flush=True)
        time.sleep(args.step_s)
    h = hashlib.sha256()
    for q in model.parameters():
        h.update(q.detach().cpu().numpy().tobytes())
    print(f"weights {h.hexdigest()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
