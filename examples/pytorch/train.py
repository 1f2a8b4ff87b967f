"""A PyTorch training script that cooperates with Keel through the SDK
(`pip install ./sdk/python`): it finds its rank and GPUs in the worker
contract, joins the job's other workers with torch.distributed (env://,
NCCL on GPUs, Gloo on CPU), reports progress, checkpoints and exits 143 on
SIGTERM, and resumes from the job's checkpoint when relaunched.

A small classifier on synthetic data, so it runs anywhere: on the GPUs
CUDA_VISIBLE_DEVICES lists, else on the CPU. Outside Keel it runs alone:

    python3 examples/pytorch/train.py --steps 200
"""

import argparse
import time

import keel
import torch
import torch.distributed as dist
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to train (default: KEEL_TOTAL_STEPS, else 1000)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64,
                        help="width of the hidden layers (larger keeps a GPU busier)")
    parser.add_argument("--layers", type=int, default=1, help="hidden layers")
    parser.add_argument("--report-every", type=int, default=10)
    args = parser.parse_args()

    ctx = keel.init()
    total_steps = args.steps or ctx.total_steps or 1000
    device = torch.device(f"cuda:{ctx.local_rank}" if torch.cuda.is_available() else "cpu")
    if ctx.world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    torch.manual_seed(0)
    hidden = [nn.Linear(32, args.hidden), nn.ReLU()]
    for _ in range(args.layers - 1):
        hidden += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*hidden, nn.Linear(args.hidden, 4)).to(device)
    if ctx.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(32, 4, device=device)

    # Resume: every rank reads the chief's last checkpoint.
    start = 0
    state = keel.load_checkpoint("train.pt", read=lambda f: torch.load(f, map_location=device))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resuming at step {start}", flush=True)

    def checkpoint(step):
        keel.save_checkpoint(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
            "train.pt", write=torch.save)

    last = time.monotonic()
    for step in range(start, total_steps):
        x = torch.randn(args.batch_size, 32, device=device)
        y = (x @ teacher).argmax(dim=1)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step + 1
        if done % args.report_every == 0 or done == total_steps:
            now = time.monotonic()
            rate = args.report_every * args.batch_size * ctx.world_size / max(now - last, 1e-9)
            last = now
            keel.report(done, loss=loss.item(), samples_per_s=rate, total_steps=total_steps)
        if keel.should_stop():
            checkpoint(done)
            keel.exit_stopped()
    checkpoint(total_steps)
    if ctx.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
