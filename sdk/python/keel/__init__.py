"""Keel's worker contract for training scripts, in a few calls.

A worker Keel launches finds its place in the job in its environment
(``KEEL_RANK``, ``KEEL_CHECKPOINT_DIR``, ...), reports progress as
``KEEL_PROGRESS {json}`` lines on stdout, treats SIGTERM as "checkpoint now
and exit" and resumes from its checkpoint directory when relaunched. This
module wraps that contract (documented in the project's README, "The worker
contract") with the standard library only::

    import keel

    ctx = keel.init()                      # reads the contract, hooks SIGTERM
    state = keel.load_checkpoint() or {"step": 0}
    for step in range(state["step"], ctx.total_steps or 1000):
        loss = train_one_step()
        keel.report(step + 1, loss=loss, samples_per_s=rate)
        if keel.should_stop():             # SIGTERM: save, then exit 143
            keel.save_checkpoint({"step": step + 1})
            keel.exit_stopped()
    keel.save_checkpoint({"step": ...})

Outside Keel (no ``KEEL_JOB_ID``) the same script runs alone: rank 0 of
one, checkpoints under ``./keel-checkpoints``.
"""

import json
import math
import os
import pickle
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = [
    "Context",
    "ContractError",
    "EXIT_STOPPED",
    "PROGRESS_MARKER",
    "checkpoint_path",
    "exit_stopped",
    "init",
    "load_checkpoint",
    "report",
    "save_checkpoint",
    "should_stop",
]

#: The prefix of a progress line on stdout (followed by one JSON object).
PROGRESS_MARKER = "KEEL_PROGRESS "
#: Keel reads progress lines up to this many bytes; longer ones stay logs.
PROGRESS_LINE_MAX_BYTES = 4096
#: The exit code of a worker that stopped on SIGTERM after checkpointing.
EXIT_STOPPED = 143
#: The checkpoint directory outside Keel.
STANDALONE_CHECKPOINT_DIR = "keel-checkpoints"


class ContractError(ValueError):
    """A contract variable or an argument is malformed; names which."""


@dataclass(frozen=True)
class Context:
    """Where this worker runs, from the contract's environment."""

    job_id: Optional[int]
    job_name: str
    epoch: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: str
    gpu_type: str
    gpus_per_worker: int
    visible_gpus: str
    checkpoint_dir: str
    rendezvous_addr: str
    rendezvous_port: Optional[int]
    model: Optional[str]
    total_steps: Optional[int]
    # Space sharing: the job on the same GPUs at the same time (None: alone).
    shared_with_job: Optional[int] = None

    @property
    def under_keel(self) -> bool:
        """Whether a Keel executor launched this process."""
        return self.job_id is not None

    @property
    def is_chief(self) -> bool:
        """Rank 0: the worker that reports progress and writes checkpoints."""
        return self.rank == 0


_context: Optional[Context] = None
_stop_requested = False


def _int(env, name: str, default: Optional[int]) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r}: not an integer") from None
    if value < 0:
        raise ContractError(f"{name}={raw!r}: must be >= 0")
    return value


def _on_sigterm(signum, frame):
    global _stop_requested
    _stop_requested = True


def init(env=None, handle_sigterm: bool = True) -> Context:
    """Reads the worker contract (``os.environ`` unless ``env`` is given)
    and, with ``handle_sigterm``, turns SIGTERM into :func:`should_stop`
    instead of an immediate exit. Call it once, first thing."""
    global _context, _stop_requested
    env = os.environ if env is None else env
    job_id = _int(env, "KEEL_JOB_ID", None)
    world_size = _int(env, "KEEL_WORLD_SIZE", None)
    if world_size is None:
        world_size = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "KEEL_RANK", None)
    if rank is None:
        rank = _int(env, "RANK", 0)
    if world_size < 1:
        raise ContractError(f"KEEL_WORLD_SIZE={world_size}: must be >= 1")
    if rank >= world_size:
        raise ContractError(f"KEEL_RANK={rank}: must be below KEEL_WORLD_SIZE={world_size}")
    checkpoint_dir = env.get("KEEL_CHECKPOINT_DIR") or (
        STANDALONE_CHECKPOINT_DIR if job_id is None else ""
    )
    if not checkpoint_dir:
        raise ContractError("KEEL_CHECKPOINT_DIR: empty under Keel")
    ctx = Context(
        job_id=job_id,
        job_name=env.get("KEEL_JOB_NAME", ""),
        epoch=_int(env, "KEEL_ALLOCATION_EPOCH", 0),
        rank=rank,
        local_rank=_int(env, "KEEL_LOCAL_RANK", _int(env, "LOCAL_RANK", 0)),
        world_size=world_size,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
        node=env.get("KEEL_NODE", ""),
        gpu_type=env.get("KEEL_GPU_TYPE", ""),
        gpus_per_worker=_int(env, "KEEL_GPUS_PER_WORKER", 0),
        visible_gpus=env.get("CUDA_VISIBLE_DEVICES", ""),
        checkpoint_dir=checkpoint_dir,
        rendezvous_addr=env.get("KEEL_RENDEZVOUS_ADDR", env.get("MASTER_ADDR", "127.0.0.1")),
        rendezvous_port=_int(env, "KEEL_RENDEZVOUS_PORT", _int(env, "MASTER_PORT", None)),
        model=env.get("KEEL_MODEL") or None,
        total_steps=_int(env, "KEEL_TOTAL_STEPS", None),
        shared_with_job=_int(env, "KEEL_SHARED_WITH_JOB", None),
    )
    _context = ctx
    _stop_requested = False
    if handle_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return ctx


def _ctx() -> Context:
    return _context if _context is not None else init(handle_sigterm=False)


def _finite(name: str, value) -> Optional[float]:
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ContractError(f"{name}={value!r}: not a number") from None
    if not math.isfinite(value):
        raise ContractError(f"{name}={value!r}: not finite")
    return value


def report(step: int, loss=None, samples_per_s=None, total_steps: Optional[int] = None,
           file=None) -> bool:
    """Reports progress: on rank 0, prints one ``KEEL_PROGRESS`` line and
    flushes. ``step`` counts steps done (an int >= 0); ``loss`` and
    ``samples_per_s`` are optional finite numbers (``samples_per_s`` >=
    0); ``total_steps`` defaults to ``KEEL_TOTAL_STEPS``. Returns whether a
    line was written (False on other ranks)."""
    ctx = _ctx()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ContractError(f"step={step!r}: must be an int >= 0")
    line = {"step": step}
    total = ctx.total_steps if total_steps is None else total_steps
    if total is not None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ContractError(f"total_steps={total!r}: must be an int >= 0")
        line["total_steps"] = total
    loss = _finite("loss", loss)
    if loss is not None:
        line["loss"] = loss
    rate = _finite("samples_per_s", samples_per_s)
    if rate is not None:
        if rate < 0:
            raise ContractError(f"samples_per_s={rate!r}: must be >= 0")
        line["samples_per_s"] = rate
    if not ctx.is_chief:
        return False
    text = PROGRESS_MARKER + json.dumps(line, separators=(",", ":"))
    if len(text.encode()) > PROGRESS_LINE_MAX_BYTES:
        raise ContractError(f"progress line of {len(text)} bytes; Keel reads {PROGRESS_LINE_MAX_BYTES}")
    out = sys.stdout if file is None else file
    out.write(text + "\n")
    out.flush()
    return True


def should_stop() -> bool:
    """Whether Keel asked this worker to stop (SIGTERM since :func:`init`):
    checkpoint, then :func:`exit_stopped`, within the grace period."""
    return _stop_requested


def exit_stopped() -> None:
    """Exits with the contract's "stopped after checkpointing" code (143)."""
    sys.stdout.flush()
    sys.exit(EXIT_STOPPED)


def checkpoint_path(name: str = "checkpoint.pt") -> str:
    """A path for ``name`` in the job's checkpoint directory (created; the
    same directory for every epoch and rank, so a relaunch finds it)."""
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise ContractError(f"checkpoint name {name!r}: must be a plain file name")
    directory = _ctx().checkpoint_dir
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


def save_checkpoint(state: Any, name: str = "checkpoint.pkl",
                    write: Optional[Callable[[Any, Any], None]] = None) -> Optional[str]:
    """Writes ``state`` atomically (a temporary file renamed over the old
    one, so a kill mid-write leaves the previous checkpoint whole) on rank
    0; other ranks write nothing and get None. ``write(state, file)``
    defaults to pickle; pass ``torch.save`` for PyTorch objects."""
    if not _ctx().is_chief:
        return None
    path = checkpoint_path(name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            (write or pickle.dump)(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_checkpoint(name: str = "checkpoint.pkl",
                    read: Optional[Callable[[Any], Any]] = None) -> Any:
    """The last checkpoint saved under ``name``, or None when there is
    none (a first start). ``read(file)`` defaults to pickle; pass
    ``torch.load`` for PyTorch objects."""
    path = checkpoint_path(name)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return (read or pickle.load)(f)
