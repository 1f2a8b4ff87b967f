"""The SDK against the worker contract (standard library only:
``python3 -m unittest discover -s sdk/python/tests``)."""

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SDK = os.path.dirname(HERE)
sys.path.insert(0, SDK)

import keel  # noqa: E402


def contract(tmp, **overrides):
    env = {
        "KEEL_JOB_ID": "7",
        "KEEL_JOB_NAME": "bert",
        "KEEL_ALLOCATION_EPOCH": "3",
        "KEEL_RANK": "0",
        "KEEL_LOCAL_RANK": "0",
        "KEEL_WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "KEEL_NODE": "n1",
        "KEEL_GPU_TYPE": "v100",
        "KEEL_GPUS_PER_WORKER": "2",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "KEEL_CHECKPOINT_DIR": os.path.join(tmp, "job-7"),
        "KEEL_RENDEZVOUS_ADDR": "10.0.0.1",
        "KEEL_RENDEZVOUS_PORT": "29500",
        "KEEL_TOTAL_STEPS": "100",
    }
    env.update(overrides)
    return env


class ContractTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def test_init_reads_every_variable(self):
        ctx = keel.init(contract(self.tmp), handle_sigterm=False)
        self.assertTrue(ctx.under_keel)
        self.assertEqual((ctx.job_id, ctx.job_name, ctx.epoch), (7, "bert", 3))
        self.assertEqual((ctx.rank, ctx.world_size, ctx.local_world_size), (0, 2, 1))
        self.assertEqual((ctx.gpu_type, ctx.gpus_per_worker, ctx.visible_gpus), ("v100", 2, "2,3"))
        self.assertEqual((ctx.rendezvous_addr, ctx.rendezvous_port), ("10.0.0.1", 29500))
        self.assertEqual(ctx.total_steps, 100)
        self.assertEqual(ctx.shared_with_job, None)
        self.assertTrue(ctx.is_chief)
        shared = keel.init(contract(self.tmp, KEEL_SHARED_WITH_JOB="9"), handle_sigterm=False)
        self.assertEqual(shared.shared_with_job, 9)

    def test_standalone_is_rank_0_of_1(self):
        ctx = keel.init({}, handle_sigterm=False)
        self.assertFalse(ctx.under_keel)
        self.assertEqual((ctx.rank, ctx.world_size), (0, 1))
        self.assertEqual(ctx.checkpoint_dir, keel.STANDALONE_CHECKPOINT_DIR)

    def test_bad_variables_name_the_variable(self):
        with self.assertRaisesRegex(keel.ContractError, "KEEL_RANK"):
            keel.init(contract(self.tmp, KEEL_RANK="two"), handle_sigterm=False)
        with self.assertRaisesRegex(keel.ContractError, "KEEL_RANK"):
            keel.init(contract(self.tmp, KEEL_RANK="2"), handle_sigterm=False)
        with self.assertRaisesRegex(keel.ContractError, "KEEL_CHECKPOINT_DIR"):
            keel.init(contract(self.tmp, KEEL_CHECKPOINT_DIR=""), handle_sigterm=False)


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def test_rank_0_prints_the_progress_line_keel_parses(self):
        keel.init(contract(self.tmp), handle_sigterm=False)
        out = io.StringIO()
        self.assertTrue(keel.report(12, loss=0.5, samples_per_s=350, file=out))
        line = out.getvalue()
        self.assertTrue(line.startswith(keel.PROGRESS_MARKER) and line.endswith("\n"))
        body = json.loads(line[len(keel.PROGRESS_MARKER):])
        self.assertEqual(body, {"step": 12, "total_steps": 100, "loss": 0.5, "samples_per_s": 350.0})

    def test_other_ranks_stay_silent(self):
        keel.init(contract(self.tmp, KEEL_RANK="1"), handle_sigterm=False)
        out = io.StringIO()
        self.assertFalse(keel.report(12, loss=0.5, file=out))
        self.assertEqual(out.getvalue(), "")

    def test_bad_arguments_name_the_field(self):
        keel.init(contract(self.tmp), handle_sigterm=False)
        out = io.StringIO()
        for kwargs, field in [
            ({"step": -1}, "step"),
            ({"step": 1.5}, "step"),
            ({"step": 1, "loss": float("nan")}, "loss"),
            ({"step": 1, "samples_per_s": -2}, "samples_per_s"),
            ({"step": 1, "total_steps": -5}, "total_steps"),
        ]:
            with self.assertRaisesRegex(keel.ContractError, field):
                keel.report(file=out, **kwargs)
        self.assertEqual(out.getvalue(), "")


class StopAndResumeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def test_sigterm_becomes_should_stop(self):
        previous = signal.getsignal(signal.SIGTERM)
        try:
            keel.init(contract(self.tmp))
            self.assertFalse(keel.should_stop())
            os.kill(os.getpid(), signal.SIGTERM)
            self.assertTrue(keel.should_stop())
        finally:
            signal.signal(signal.SIGTERM, previous)

    def test_checkpoints_round_trip_on_rank_0_only(self):
        keel.init(contract(self.tmp), handle_sigterm=False)
        self.assertIsNone(keel.load_checkpoint())
        path = keel.save_checkpoint({"step": 40})
        self.assertEqual(os.path.dirname(path), os.path.join(self.tmp, "job-7"))
        self.assertEqual(keel.load_checkpoint(), {"step": 40})
        keel.save_checkpoint({"step": 80})
        self.assertEqual(keel.load_checkpoint(), {"step": 80})
        self.assertEqual(os.listdir(os.path.dirname(path)), ["checkpoint.pkl"], "no temporary left")
        keel.init(contract(self.tmp, KEEL_RANK="1"), handle_sigterm=False)
        self.assertIsNone(keel.save_checkpoint({"step": 99}))
        self.assertEqual(keel.load_checkpoint(), {"step": 80}, "ranks read the chief's checkpoint")
        with self.assertRaisesRegex(keel.ContractError, "plain file name"):
            keel.checkpoint_path("../escape")

    def test_a_stopped_worker_exits_143_after_checkpointing_and_resumes(self):
        script = textwrap.dedent(
            """
            import os, signal, sys, time
            sys.path.insert(0, sys.argv[1])
            import keel
            ctx = keel.init()
            state = keel.load_checkpoint() or {"step": 0}
            print("resumed at", state["step"], flush=True)
            for step in range(state["step"], 10_000):
                if step == 5 and state["step"] == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                keel.report(step + 1)
                if keel.should_stop():
                    keel.save_checkpoint({"step": step + 1})
                    keel.exit_stopped()
            keel.save_checkpoint({"step": 10_000})
            """
        )
        env = dict(os.environ, **contract(self.tmp, KEEL_TOTAL_STEPS="10000"))
        first = subprocess.run([sys.executable, "-c", script, SDK], env=env,
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(first.returncode, keel.EXIT_STOPPED, first.stderr)
        self.assertIn("resumed at 0", first.stdout)
        self.assertIn('KEEL_PROGRESS {"step":6,"total_steps":10000}', first.stdout)
        second = subprocess.run([sys.executable, "-c", script, SDK], env=env,
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(second.returncode, 0, second.stderr)
        self.assertIn("resumed at 6", second.stdout)


if __name__ == "__main__":
    unittest.main()
