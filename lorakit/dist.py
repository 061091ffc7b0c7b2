"""Small torch.distributed helpers that also work with a single process, and the rules that keep a failure
on one rank from stranding the others: work that only rank 0 does (`on_main`) or that every rank does on
its own (`on_every_rank`) ends in one collective where every rank learns whether any failed, and `phase`
labels what the process is doing so a stuck collective's error says where it was stuck."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lorakit.errors import CollectiveTimeoutError, RankFailedError

T = TypeVar("T")


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 when not distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def processes_per_node() -> int | None:
    """This node's number of processes as the launcher says it (torchrun: LOCAL_WORLD_SIZE, the deepspeed
    launcher: LOCAL_SIZE); None where neither is set."""
    per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return int(per_node) if per_node else None


def is_main() -> bool:
    """Whether this is rank 0, the process that writes the run directory."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers across ranks, in float64 so token counts stay exact."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        # gloo reduces CPU tensors; nccl only reduces tensors on the GPU.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu().tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not dist.is_initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Coordination:
    """What one job's phases and agreements keep: what the process is doing now, for error messages (the
    phase's name and its step, an int or a callable giving it), and the recorders to call with a failure of
    on_main / on_every_rank work as it happens (api records it in exit.json)."""

    phase: str = "start-up"
    step: int | Callable[[], int] | None = None
    recorders: list[Callable[[BaseException], None]] = field(default_factory=list)


# The Coordination of the job running in this context: set by the outermost `coordination()` block (a job,
# lorakit.api's failure recording) and reset when it ends, so a second job in the process starts blank.
_CURRENT: ContextVar[Coordination | None] = ContextVar("lorakit_coordination", default=None)
# Set once a collective failed for want of a peer: such a group cannot be torn down cleanly (gloo's
# destructor aborts the process), so the CLI ends the process at once with its exit code. It describes the
# process group, which is the process's own (torch.distributed's default group), not one job's.
_BROKEN: list[bool] = [False]


@contextlib.contextmanager
def coordination() -> Iterator[Coordination]:
    """The running job's Coordination for the block: the enclosing block's, or a new one this block owns
    (and drops when it ends)."""
    current = _CURRENT.get()
    if current is not None:
        yield current
        return
    token = _CURRENT.set(Coordination())
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def _now() -> Coordination:
    # Outside any job: a blank one (start-up, nobody recording).
    return _CURRENT.get() or Coordination()


# Text in a collective's error that says a peer vanished or the collective timed out (gloo raises plain
# RuntimeErrors; NCCL and the store raise DistError subclasses).
_COLLECTIVE_TEXT = ("connection closed by peer", "connection reset by peer", "timed out", "broken pipe")


def where() -> str:
    """The current phase (and step, when it has one), e.g. `checkpoint save at step 4`."""
    now = _now()
    name, step = now.phase, now.step
    step = step() if callable(step) else step
    return f"{name} at step {step}" if step is not None else name


@contextlib.contextmanager
def phase(name: str, step: int | Callable[[], int] | None = None) -> Iterator[None]:
    """Label the work of the block as `name` (at `step`, an int or a callable read when an error happens).

    An error raised in the block remembers the phase (for the root-cause line); a collective that failed
    because a peer died or stalled past distributed.timeout_minutes becomes a CollectiveTimeoutError that
    names the phase and step, instead of a backend traceback."""
    with coordination() as now:
        previous = (now.phase, now.step)
        now.phase, now.step = name, step
        try:
            yield
        except CollectiveTimeoutError:
            raise
        except Exception as e:
            if not hasattr(e, "lorakit_where"):
                e.lorakit_where = where()
            if collective_failure(e):
                _BROKEN[0] = True
                stopped = CollectiveTimeoutError(
                    f"rank {rank()} stopped during {e.lorakit_where}: a collective did not complete "
                    f"({_first_line(e)}); another rank failed (its error comes first) or stalled longer "
                    "than distributed.timeout_minutes"
                )
                stopped.lorakit_where = e.lorakit_where
                # On record at once, with where this rank was stuck: under torchrun the agent, which saw
                # the peer die, ends this process soon, and a peer that died without a word (SIGKILL) has
                # only this record to say where the run was (launch.root_cause_line).
                _record(stopped)
                raise stopped from e
            raise
        finally:
            now.phase, now.step = previous


def initialized() -> bool:
    """Whether this process belongs to an initialised process group."""
    return dist.is_initialized()


def group_broken() -> bool:
    """Whether a collective of this process failed because a peer died or stalled (see `phase`)."""
    return _BROKEN[0]


def collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed for want of a peer (dead, or past the group's timeout)."""
    if isinstance(error, RankFailedError):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in text for t in _COLLECTIVE_TEXT)


def describe_failure(error: BaseException) -> str:
    """One line for the launcher: which rank failed, where, and the error (type and first line)."""
    if isinstance(error, CollectiveTimeoutError):
        return _first_line(error)  # already says which rank stopped where, and why
    at = getattr(error, "lorakit_where", None) or where()
    return f"rank {rank()} failed during {at}: {type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


@contextlib.contextmanager
def recording_failures(record: Callable[[BaseException], None]) -> Iterator[None]:
    """Inside the block, `record(error)` is called on the failing rank as soon as on_main / on_every_rank
    work fails, before the agreement's collective: if another rank is inside a collective of its own
    (DeepSpeed's, mid-checkpoint) the agreement cannot complete, and the root cause must be on record."""
    with coordination() as now:
        now.recorders.append(record)
        try:
            yield
        finally:
            now.recorders.remove(record)


def _record(error: BaseException) -> None:
    for record in list(_now().recorders):
        with contextlib.suppress(Exception):
            record(error)


def on_main(
    name: str, fn: Callable[..., T], *args: Any, share: bool = False, at: int | None = None, **kwargs: Any
) -> T | None:
    """Run `fn(*args, **kwargs)` on rank 0 only, as phase `name`; every rank then learns its outcome in one
    collective, so an error on rank 0 stops every rank at once instead of leaving them in the next
    collective. Rank 0 re-raises its error; the others raise RankFailedError naming it. Returns fn's result
    on rank 0 (on every rank with `share`), None elsewhere. `at`: the step, for the error (default: the
    enclosing phase's). Call it on every rank at the same point."""
    step = _now().step if at is None else at
    result, error = _attempt(name, step, fn, args, kwargs) if is_main() else (None, None)
    outcomes = _agree(name, step, error, result if share else None)
    return outcomes[0] if share else result


def on_every_rank(name: str, fn: Callable[..., T], *args: Any, at: int | None = None, **kwargs: Any) -> T:
    """Run `fn(*args, **kwargs)` on every rank as phase `name`, then agree: if any rank failed, each
    raises (the failing rank its own error, the others RankFailedError naming it), so no rank goes on to
    a collective the failed one will never join, and none cleans up what another may still be writing."""
    step = _now().step if at is None else at
    result, error = _attempt(name, step, fn, args, kwargs)
    _agree(name, step, error, None)
    return result


def _attempt(name: str, step, fn: Callable[..., T], args, kwargs) -> tuple[T | None, Exception | None]:
    """fn(*args, **kwargs) as phase `name`: (its result, None), or (None, its error) recorded as this rank's
    root cause before the agreement's collective, which may never complete."""
    try:
        with phase(name, step):
            return fn(*args, **kwargs), None
    except Exception as e:
        _record(e)
        return None, e


def _agree(name: str, step, error: Exception | None, value: Any) -> list[Any]:
    """Gather every rank's (failure, value); raise if any rank failed; return the values in rank order."""
    mine = describe_failure(error) if error is not None else None
    try:
        with phase(name, step):
            gathered = all_gather_objects((mine, value))
    except CollectiveTimeoutError:
        if error is not None:
            raise error from None  # this rank's own failure is the root cause, not the gather's
        raise
    if error is not None:
        raise error
    failed = [(r, text) for r, (text, _) in enumerate(gathered) if text is not None]
    if failed:
        raise RankFailedError(f"{failed[0][1]}; rank {rank()} stopped with it")
    return [v for _, v in gathered]
