"""Fault injection for the resume tests, loaded at interpreter start (PYTHONPATH) by every process.

LORAKIT_FAULT=ACTION:STEP acts in the process that trains rank 0: the rank-0 worker under torchrun (which
sets RANK), or a 1-process run (no RANK; a launcher that starts torchrun never trains itself):
- kill:N      SIGKILL every process of the launch (launcher, torchrun, every worker) after step N's update,
              before it is logged: a node dying.
- term:N      SIGTERM the launcher (`python -m lorakit.run`) after step N, as Kubernetes does to a
              container's first process on preemption; it must pass the request on.
- nan:N       make micro-batch N's loss NaN (with accumulation 1: step N's).
- crash-save:N  die (os._exit) while writing step N's checkpoint, after its files are written and before the
              directory is published.
- enospc:GLOB, disk-full:GLOB, readonly:GLOB  the disk faults of tests/disk_faults.py for paths matching GLOB:
              writes that run out of space part-way, a filesystem reporting no free space, a read-only one.

LORAKIT_HOLD_UNTIL=PATH (the process that trains rank 0): before the first step, create PATH.waiting and wait
until PATH exists, so a test can act while a run is known to be training.

LORAKIT_RAISE=PHASE@RANK[:N] (the worker of that rank): raise RuntimeError("injected in PHASE") in the Nth
(default first) call of the phase's work on that rank (tests/fault_injection.py: load, prepare, tracker
start, step, tracker log (every TensorBoard write from the Nth on fails), eval write, checkpoint save (this
rank's part), checkpoint publish, adapter save, summary; docs/faults.md). LORAKIT_RAISE_AS=SIGKILL makes the
process kill itself there instead, LORAKIT_RAISE_AS=exit:N end with os._exit(N). With
LORAKIT_FAULT_STAMP=PATH it appends the time of each injected failure to PATH.

LORAKIT_BNB_AVX512BF16=0|1 (every process): force bitsandbytes' AVX512-BF16 answer (tests/bnb_layout.py).
"""

import os

if os.environ.get("LORAKIT_BNB_AVX512BF16") in ("0", "1"):
    from tests.bnb_layout import force_avx512bf16_when_imported

    force_avx512bf16_when_imported(os.environ["LORAKIT_BNB_AVX512BF16"] == "1")

_spec = os.environ.get("LORAKIT_FAULT")
if _spec and os.environ.get("RANK", "0") == "0":
    import signal

    _action, _arg = _spec.split(":", 1)
    _step = int(_arg) if _action in ("kill", "term", "nan", "crash-save") else None

    if _action in ("enospc", "disk-full", "readonly"):
        from tests.disk_faults import DiskFaults

        DiskFaults(_action, _arg).install()
    elif _action in ("kill", "term"):
        import lorakit.engine.loop as _loop

        # A process's parent as a fresh interpreter's: a rank served by the suite's fork server is the server's
        # child, and stands for the `python` its torchrun started (tests/docs/zygote.py).
        from tests.docs.zygote import fresh_parent as _ppid

        _train_window = _loop.train_window
        _calls = {"n": 0}

        def _faulty_train_window(*args, **kwargs):
            _calls["n"] += 1
            if _action == "term" and _calls["n"] == _step:
                # Sent as step N starts: the loop reads each rank's stop request as the step ends (on its
                # closing all_reduce). The request travels launcher -> torchrun -> workers; waiting here until
                # it has reached this worker makes the run stop at step N however loaded the machine is.
                os.kill(_ppid(_ppid(os.getpid())), signal.SIGTERM)
                _await_stop_request()
            out = _train_window(*args, **kwargs)
            if _action == "kill" and _calls["n"] == _step:
                agent = _ppid(os.getpid())  # torchrun, which starts each worker in a session of its own
                launcher = _ppid(agent)
                workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _safe_ppid(int(p)) == agent]
                for pid in [launcher, agent, *(w for w in workers if w != os.getpid()), os.getpid()]:
                    os.kill(pid, signal.SIGKILL)
            return out

        def _await_stop_request(limit=120.0):
            import time

            owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
            deadline = time.monotonic() + limit
            while owner is not None and owner.received is None and time.monotonic() < deadline:
                time.sleep(0.05)

        def _safe_ppid(pid):
            try:
                return _ppid(pid)
            except OSError:
                return None

        _loop.train_window = _faulty_train_window
    elif _action == "nan":
        # The SFT objective computes the loss the loop backpropagates.
        import lorakit.objectives.sft as _objective

        _token_loss_sum = _objective.token_loss_sum
        _calls = {"n": 0}

        def _nan_loss(*args, **kwargs):
            out = _token_loss_sum(*args, **kwargs)
            _calls["n"] += 1
            return out * float("nan") if _calls["n"] == _step else out

        _objective.token_loss_sum = _nan_loss
    elif _action == "crash-save":
        import lorakit.engine.checkpoint as _ckpt
        import lorakit.storage as _storage

        _fsync_tree = _storage.fsync_tree

        def _crash_before_publish(path):
            # The checkpoint's files are written (its manifest too) and are being flushed before the rename.
            if os.path.basename(path) == f"{_ckpt._TMP_PREFIX}step-{_step:08d}":
                os._exit(9)
            _fsync_tree(path)

        _storage.fsync_tree = _crash_before_publish
    else:
        raise ValueError(f"LORAKIT_FAULT: unknown action {_action!r}")

_hold = os.environ.get("LORAKIT_HOLD_UNTIL")
if _hold and os.environ.get("RANK", "0") == "0":
    import time

    import lorakit.engine.loop as _hold_loop

    _held_window = _hold_loop.train_window

    def _train_window_after_hold(*args, **kwargs):
        if not os.path.exists(_hold):
            open(_hold + ".waiting", "w").close()
        while not os.path.exists(_hold):
            time.sleep(0.2)
        return _held_window(*args, **kwargs)

    _hold_loop.train_window = _train_window_after_hold


_raise = os.environ.get("LORAKIT_RAISE")
if _raise:
    _phase, _where = _raise.split("@")
    _rank, _, _nth = _where.partition(":")
    if os.environ.get("RANK", "0") == _rank:
        from tests.fault_injection import inject

        inject(
            _phase,
            int(_nth or 1),
            os.environ.get("LORAKIT_RAISE_AS", "raise"),
            os.environ.get("LORAKIT_FAULT_STAMP"),
        )
