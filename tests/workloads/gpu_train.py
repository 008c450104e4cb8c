"""A small deterministic CUDA training job for scripts/gpu-check (needs PyTorch and a GPU).

Holds `--hold-gib` GiB of tensors on the GPU, trains a seeded MLP for `--steps` steps (sleeping
`--step-sleep` s each, so there is time to checkpoint it mid-run), appends "<step> <loss>" to
`--log` after every step, and at the end writes "done <steps> <checksum>" where the checksum
is over the final weights and the held tensors. The same arguments give the same checksum,
interrupted or not: that is what a checkpoint and restore must preserve."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--hold-gib", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    elements = int(args.hold_gib * (1 << 30) / 4)
    held = torch.arange(elements, device=device, dtype=torch.float32).remainder_(9973.0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512)).to(device)
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(256, 512, device=device, generator=None)
    target = torch.randn(256, 512, device=device)
    with open(args.log, "a", buffering=1) as log:
        for step in range(1, args.steps + 1):
            optimiser.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            optimiser.step()
            log.write(f"{step} {loss.item():.8f}\n")
            time.sleep(args.step_sleep)
        digest = hashlib.sha256()
        for tensor in [*model.parameters(), held]:
            digest.update(tensor.detach().cpu().numpy().tobytes())
        log.write(f"done {args.steps} {digest.hexdigest()[:16]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
