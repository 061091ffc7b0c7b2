"""Measures tensor memory of real lorakit training steps on FSDP2 and plans the same setups; one JSON per setup.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.integration.plan_fsdp_worker OUT RECIPE.yaml ...

Launched by test_plan_measured.py, as plan_worker.py for DeepSpeed. FSDP2 frees and refills its gathered
parameters by resizing their storages, which lorakit.meter.TensorMemoryTracker (it sees operators' outputs)
would miss, so the bytes come from the CPU allocator itself: torch.profiler's memory events, every allocation
and free since the profile began. The profile spans building, sharding and two optimizer steps on the fullest
micro-batch (as the job does: lorakit.backends' backend_for, load_config, build_model with its load_plan, wrap); per rank it
records the peak within the second step, and the bytes of the tensors alive after it (model states, counted
as plan_worker.py counts them: the storages Python sees).

The bytes alive are summed from the events (allocated_series), not read from the profiler's running total:
gloo copies a reduce-scatter's input inside the collective and may drop that copy on its own worker thread,
which the profiler does not record, so the running total kept up to 1.4 MB of freed copies on some runs and
not on others (18.47 to 19.98 MB for the same step). Those copies are the backend's (NCCL makes none, and a
GPU's max_memory_allocated, which the plan models, does not see its buffers): allocations made inside a
c10d collective are left out, and a block whose address is handed out again without a recorded free is
counted as freed by then.
"""

import bisect
import gc
import json
import sys
from pathlib import Path


def _memory_events(prof) -> tuple[list[tuple[float, int]], tuple[float, float]]:
    """(time, bytes alive) after every allocation and free (allocated_series), and the span of the "second
    step" marker."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        events = json.loads(Path(f"{d}/trace.json").read_text())["traceEvents"]
    step = next(e for e in events if e.get("name") == "second step" and "dur" in e)
    return allocated_series(events), (step["ts"], step["ts"] + step["dur"])


def allocated_series(events: list[dict]) -> list[tuple[float, int]]:
    """(time, bytes alive) after each memory event of a chrome trace, without the communication backend's
    own copies (blocks allocated inside a c10d collective) and with a block counted freed once its address is
    allocated again (its free happened on a thread the profiler does not record)."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name", "").startswith("c10d::"):
            spans.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for v in spans.values():
        v.sort()
    starts = {tid: [s for s, _ in v] for tid, v in spans.items()}

    def in_collective(tid, ts) -> bool:
        i = bisect.bisect_right(starts.get(tid, []), ts) - 1
        return i >= 0 and spans[tid][i][1] >= ts

    alive: dict[int, int] = {}
    total, series = 0, []
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0:
            total -= alive.pop(addr, 0)
            alive[addr] = 0 if in_collective(e["tid"], e["ts"]) else nbytes
            total += alive[addr]
        else:
            # A block allocated before the profile began counts as its free says, as the running total did.
            total -= alive.pop(addr, -nbytes)
        series.append((e["ts"], total))
    return series


def _tensor_bytes() -> int:
    """Bytes of the storages of every CPU tensor Python can see, each once (DTensors through their local
    tensors: the wrapper reports the whole tensor's size)."""
    import torch

    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and type(obj).__name__ != "DTensor" and not obj.is_meta:
            s = obj.untyped_storage()
            if s.device.type == "cpu":
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def measure(path: str, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.data import DataLoader

    import lorakit
    from lorakit import dist
    from lorakit.backends import backend_for
    from lorakit.data import prepare_data
    from lorakit.data.batching import make_batching
    from lorakit.engine.loop import train_window
    from lorakit.engine.schedule import lambda_lr_factory
    from lorakit.meter import TokenMeter
    from lorakit.model import build_model, load_config, load_tokenizer
    from tests.integration.plan_worker import write_result

    recipe = lorakit.load_recipe(path)
    source, config = load_config(recipe)
    tokenizer = load_tokenizer(recipe, source)
    data = prepare_data(recipe, tokenizer, config)  # the test prepared the cache: this only reads it
    backend = backend_for(recipe)
    described = backend.describe(config)
    gc.collect()
    baseline = _tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        built = build_model(recipe, backend.load_plan(described))
        engine = backend.wrap(built, described, lambda_lr_factory(10, 0.0, recipe.train.lr_schedule))
        batching = make_batching(
            recipe, data, tokenizer, config, packing=built.packing, world=dist.world_size(), rank=dist.rank()
        )
        loader = DataLoader(data.train, batch_sampler=batching.sampler, collate_fn=batching.collator)
        # The same, fullest micro-batch on every rank: the plan is a worst case over micro-batches.
        batch = max(loader, key=lambda b: (int(b["num_token_slots"]), len(b["input_ids"])))
        window = [batch] * recipe.train.gradient_accumulation_steps
        engine.train()  # as the training loop does: dropout on
        train_window(engine, built.inputs, window, TokenMeter())
        gc.collect()
        with record_function("second step"):
            train_window(engine, built.inputs, window, TokenMeter())
        gc.collect()
    rest = _tensor_bytes() - baseline
    totals, (start, end) = _memory_events(prof)
    before = [t for ts, t in totals if ts < start]
    peak = max([before[-1] if before else 0] + [t for ts, t in totals if start <= ts <= end])
    write_result(out, path, recipe, config, built, batching, batch, rest, peak)
    dist.barrier()
    engine.close()


def main(out: str, paths: list[str]) -> None:
    from lorakit.engine.launch import process_group

    with process_group("gloo"):
        for path in paths:
            measure(path, Path(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
