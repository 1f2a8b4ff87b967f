"""The worker contract through the SDK with the standard library only:
counts steps at a steady pace, reports them, checkpoints and exits 143 on
SIGTERM, resumes from its checkpoint. The end-to-end tests run it under a
real Keel server; it is also the smallest template for a script of your own.

    python3 examples/pytorch/minimal.py --steps-per-s 50
"""

import argparse
import time

import keel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-per-s", type=float, default=100.0)
    args = parser.parse_args()

    ctx = keel.init()
    total_steps = ctx.total_steps or 1000
    state = keel.load_checkpoint() or {"step": 0}
    print(f"rank {ctx.rank} of {ctx.world_size} on {ctx.gpu_type or 'no GPU'}, "
          f"epoch {ctx.epoch}, from step {state['step']}", flush=True)
    step = state["step"]
    while step < total_steps:
        time.sleep(1.0 / args.steps_per_s)
        step += 1
        if step % 10 == 0 or step == total_steps:
            keel.report(step, loss=1.0 / step, samples_per_s=args.steps_per_s)
        if keel.should_stop():
            keel.save_checkpoint({"step": step})
            keel.exit_stopped()
    keel.save_checkpoint({"step": step})


if __name__ == "__main__":
    main()
