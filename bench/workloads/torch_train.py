"""A PyTorch training job: a deep MLP trained by Adam on a synthetic regression task, as a model
being trained holds its weights, their gradients and the optimiser's two moments.

    python3 torch_train.py [MIB] [WIDTH]

The model is square Linear layers of WIDTH (1024) with GELU between them, as many as make its
weights, gradients and Adam state together about MIB MiB (256).  Each step draws a minibatch from
a seeded generator, runs forward and backward and takes an Adam step; every 20 steps it prints
the step and the loss.  ``ready`` is printed after the first 20 steps, so a checkpoint finds the
weights trained a while and the optimiser's state in place.
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    torch.manual_seed(7)
    torch.set_num_threads(1)
    per_layer = width * (width + 1) * 4 * 4  # weights and bias, float32: themselves, grads, two Adam moments
    layers = max(1, mib * (1 << 20) // per_layer)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks[:-1], torch.nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    target = torch.randn(width, 1) / width ** 0.5
    step = 0
    while True:
        x = torch.randn(64, width)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step == 20:
                print("ready", flush=True)


if __name__ == "__main__":
    main()
