"""Small torch.distributed helpers that also work with a single process, and the rules that keep a failure
on one rank from stranding the others: work that only rank 0 does (`on_main`) or that every rank does on
its own (`on_every_rank`) ends in one collective where every rank learns whether any failed, and `phase`
labels what the process is doing so a stuck collective's error says where it was stuck."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
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
    if error is not None and group_broken():
        raise error  # no collective of this group can complete any more (foreign_collectives)
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


# A rank that fails inside another library's collectives (foreign_collectives) leaves its root-cause line
# in the group's store under this key, as [rank, line]; each other rank adds 1 under _HEARD once it read it.
_NOTICE = "lorakit/failed-inside-collectives"
_HEARD = _NOTICE + "/heard"
_POLL_SECONDS = 0.5  # two requests a second to the store from each rank, and only inside the block
# How long the failing rank waits for the others to read its line before it leaves, and how long a rank
# that read it waits for its own collective to fail (the failing rank's connections closing) before it
# ends its process itself (a backend, NCCL, that waits for distributed.timeout_minutes instead).
NOTICE_WAIT_SECONDS = 10.0
GIVE_UP_SECONDS = 20.0


@contextlib.contextmanager
def foreign_collectives(give_up: float = GIVE_UP_SECONDS) -> Iterator[None]:
    """Run a block that enters another library's collectives (DeepSpeed's barriers inside its checkpoint
    save): a rank that fails there cannot reach lorakit's agreement, because the others wait in the
    library's next collective, not in the agreement. So the failing rank records its root cause, leaves the
    line in the group's store for the others to read and then leaves the group (group_broken: no agreement
    is attempted, the CLI ends the process at once, which closes its connections). The others watch the
    store while they are in the block: their collective then fails and they raise RankFailedError naming
    the root cause; where it does not fail soon (NCCL), the watching thread prints that line and ends the
    process with exit code 1 after `give_up` seconds instead of waiting out distributed.timeout_minutes."""
    store = _store() if world_size() > 1 else None
    if store is None:
        yield
        return
    heard: list[str] = []
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(store, heard, done, give_up), daemon=True)
    watcher.start()
    try:
        yield
    except Exception as e:
        if heard:  # another rank failed first; this rank's collective failed because of it
            _BROKEN[0] = True
            raise RankFailedError(f"{heard[0]}; rank {rank()} stopped with it") from e
        if not collective_failure(e):  # this rank's own failure: the root cause
            _BROKEN[0] = True
            _record(e)
            _tell_others(store, describe_failure(e))
        raise
    finally:
        done.set()
        watcher.join()


def _store():
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


def _tell_others(store, line: str) -> None:
    """Leave `line` for the other ranks and wait (at most NOTICE_WAIT_SECONDS) until each has read it."""
    with contextlib.suppress(Exception):
        store.set(_NOTICE, json.dumps([rank(), line]))
        deadline = time.monotonic() + NOTICE_WAIT_SECONDS
        while store.add(_HEARD, 0) < world_size() - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)


def _watch(store, heard: list[str], done: threading.Event, give_up: float) -> None:
    """Poll the store for another rank's line until `done`; once read, give the collective `give_up`
    seconds to fail, then end the process with the line."""
    while not done.wait(_POLL_SECONDS):
        try:
            if not store.check([_NOTICE]):
                continue
            sender, line = json.loads(store.get(_NOTICE))
        except Exception:
            return  # the store is gone (its host left): this rank's collective fails on its own
        if sender == rank():
            continue
        heard.append(line)
        with contextlib.suppress(Exception):
            store.add(_HEARD, 1)
        if not done.wait(give_up):
            from lorakit.disclosure import redact

            print(redact(f"error: {line}; rank {rank()} stopped with it"), file=sys.stderr, flush=True)
            os._exit(RankFailedError.exit_code)
        return
