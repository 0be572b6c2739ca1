"""A numpy training job: a two-layer MLP trained by minibatch SGD on a synthetic regression set
held in memory, as a small scientific job holds its data and its model.

    python3 numpy_train.py [DATA_MIB] [HIDDEN]

The data set (DATA_MIB MiB of float32 features, a seeded generator) and the weights live in
the process; each step takes a minibatch, does the forward and backward passes and updates the
weights, and every 50 steps prints the step and the loss.  ``ready`` is printed after the first
50 steps, so a checkpoint finds the weights trained a while and the optimiser's state in place.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> None:
    data_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    dim = 256
    rows = data_mib * (1 << 20) // (dim * 4)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    true_w = rng.standard_normal((dim, 1), dtype=np.float32) / 16
    y = np.tanh(x @ true_w) + 0.01 * rng.standard_normal((rows, 1), dtype=np.float32)
    w1 = (rng.standard_normal((dim, hidden), dtype=np.float32) / np.sqrt(dim)).astype(np.float32)
    b1 = np.zeros(hidden, dtype=np.float32)
    w2 = (rng.standard_normal((hidden, 1), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
    m = [np.zeros_like(p) for p in (w1, b1, w2)]  # momentum, as an optimiser's state
    lr, batch, step = 0.01, 256, 0
    while True:
        idx = rng.integers(0, rows, batch)
        xb, yb = x[idx], y[idx]
        h = np.maximum(xb @ w1 + b1, 0)
        err = h @ w2 - yb
        g2 = h.T @ err / batch
        gh = (err @ w2.T) * (h > 0)
        g1, gb1 = xb.T @ gh / batch, gh.mean(axis=0)
        for p, g, v in zip((w1, b1, w2), (g1, gb1, g2), m):
            v *= 0.9
            v += g
            p -= lr * v
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {float((err ** 2).mean()):.6f}", flush=True)
            if step == 50:
                print("ready", flush=True)
        time.sleep(0.001)


if __name__ == "__main__":
    main()
