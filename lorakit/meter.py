"""Throughput and memory meters: tokens/s, packing efficiency, peak memory, model FLOPs and MFU."""

from __future__ import annotations

import resource
import sys

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, without sparsity), matched against
# torch.cuda.get_device_name in this order (so "H100 PCIe" is found before "H100").
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def peak_tflops(device_name: str | None) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None when unknown (CPUs, unlisted GPUs)."""
    if not device_name:
        return None
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def lora_training_flops(frozen: float, lora: float, attention: float = 0.0) -> dict[str, float]:
    """Training FLOPs of a LoRA step counted two ways, from the frozen and LoRA matmul parameters a token
    passes through (or their sums over the step's tokens) and the attention's forward FLOPs (4 x heads x
    head_dim per query-key pair and layer).

    lorakit: what the step computes: forward (2) and input gradient (2) through each frozen weight, the
    full 6 through each LoRA weight, attention x3. nemo: NeMo AutoModel's LoRA count, the full
    fine-tuning FLOPs of the model (6 per frozen weight, attention x3) scaled by (2 + lora/frozen)/3, i.e.
    without the frozen weights' weight-gradient GEMM; its 40.6% MFU anchor is this count."""
    if frozen <= 0:
        raise ValueError(f"frozen matmul parameters must be positive, got {frozen}")
    full = 6 * frozen + 3 * attention
    return {"lorakit": 4 * frozen + 6 * lora + 3 * attention, "nemo": full * (2 + lora / frozen) / 3}


def matmul_params(model: torch.nn.Module) -> dict[str, int]:
    """Weights of the model's linear layers a token multiplies by: {frozen, lora} (in x out of every
    linear layer, so ZeRO-3 / FSDP2 shards and 4-bit packing count as the full layer). LoRA's A and B
    are the lora part; DoRA's magnitude and experts held outside nn.Linear (fused MoE) are not counted."""
    frozen = lora = 0
    for name, module in model.named_modules():
        # bitsandbytes' 4-bit and 8-bit layers are nn.Linear too; peft's LoRA wrapper is not (its
        # base_layer and lora_A/lora_B children are).
        if not isinstance(module, torch.nn.Linear) or any(True for _ in module.children()):
            continue
        size = int(module.in_features) * int(module.out_features)
        if ".lora_A." in f"{name}." or ".lora_B." in f"{name}.":
            lora += size
        else:
            frozen += size
    return {"frozen": frozen, "lora": lora}


def flops_summary(
    params: dict[str, int], *, full: bool, seq2seq: bool, tokens_per_second: float, world_size: int
) -> dict:
    """summary.json's `flops`: the linear layers' training FLOPs per non-pad token as lorakit and NeMo
    count them (`params` from matmul_params; `full`: every weight trains, both counts are 6 per weight),
    and the MFU each gives against this device's bf16 datasheet peak (None on CPUs and unlisted GPUs).
    Attention is not counted here (benchmarks/harness/steps.py counts it from the batches' lengths)."""
    frozen, lora = params["frozen"], params["lora"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out = {"counted": "linear layers per non-pad token, attention excluded", "device": device}
    if seq2seq or frozen <= 0:
        # A source token passes the encoder only, a target token the decoder: one per-token count is wrong.
        why = "encoder-decoder: per-token FLOPs differ by side" if seq2seq else "no linear layers found"
        return {
            **out,
            "flops_per_token": None,
            "peak_tflops": None,
            "mfu": None,
            "mfu_nemo": None,
            "why": why,
        }
    everything = 6.0 * (frozen + lora)
    counts = {"lorakit": everything, "nemo": everything} if full else lora_training_flops(frozen, lora)
    peak = peak_tflops(device)
    per_device = tokens_per_second / max(world_size, 1)
    mfu = {k: (per_device * v / (peak * 1e12) if peak else None) for k, v in counts.items()}
    return {
        **out,
        "flops_per_token": counts,
        "peak_tflops": peak,
        "mfu": mfu["lorakit"],
        "mfu_nemo": mfu["nemo"],
    }


def peak_memory() -> dict[str, int | None]:
    """Peak accelerator memory allocated by torch and peak resident CPU memory of this process, in bytes."""
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux, bytes on macOS.
    return {"gpu": gpu, "cpu_rss": int(rss if sys.platform == "darwin" else rss * 1024)}


class TokenMeter:
    """Counts useful tokens (non-pad) and token slots (padding included) as batches go by."""

    def __init__(self) -> None:
        self.real = 0
        self.slots = 0
        self.samples = 0

    def add(self, batch: dict) -> None:
        self.real += int(batch["num_real_tokens"])
        self.slots += int(batch["num_token_slots"])
        # A packed row holds several examples: collators say how many.
        self.samples += int(batch["num_examples"])

    def efficiency(self) -> float:
        """Useful tokens / token slots: 1.0 means no compute was spent on padding."""
        return self.real / self.slots if self.slots else 0.0

    def counters(self) -> dict[str, int]:
        """This rank's counts, as a checkpoint stores them."""
        return {"samples": self.samples, "real": self.real, "slots": self.slots}

    @classmethod
    def from_counters(cls, counters: dict[str, int]) -> TokenMeter:
        """A meter that continues the counts of `counters()` (a resumed run)."""
        meter = cls()
        meter.samples, meter.real, meter.slots = counters["samples"], counters["real"], counters["slots"]
        return meter


def _live_storages(device_type: str | None = None) -> dict[int, torch.UntypedStorage]:
    """Every storage of a live tensor that Python can see (parameters, gradients, optimizer state, buffers
    held by DeepSpeed), by identity; `device_type` ("cpu", "cuda") filters. Objects frozen out of collection
    (gc.freeze: what a launched rank imported before its job, lorakit.run) are not seen; no model's are."""
    import gc
    import warnings

    out: dict[int, torch.UntypedStorage] = {}
    with warnings.catch_warnings():
        # isinstance() on some deprecated torch.distributed objects warns; they are not tensors anyway.
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance() reads __class__, and a weakref.proxy whose referent
            # died raises ReferenceError on that.
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
                continue
            if is_traceable_wrapper_subclass(obj):
                continue  # a DTensor (FSDP2) owns no memory: gc sees the local shard it wraps on its own
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # sparse and other storage-less tensors
            if device_type is None or storage.device.type == device_type:
                out[id(storage)] = storage
    return out


def _plain_tensors(t) -> list[torch.Tensor]:
    """The tensors that own memory in `t`: itself, or for a wrapper such as a DTensor the tensors it wraps."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return []
    if is_traceable_wrapper_subclass(t):
        return [x for name in t.__tensor_flatten__()[0] for x in _plain_tensors(getattr(t, name))]
    return [t]


def live_tensor_bytes(device_type: str | None = None) -> int:
    """Bytes of every live tensor storage in this process (each storage once, however many views share
    it). Call it between steps: on CPU this is the measured counterpart of the planner's model states."""
    return sum(s.nbytes() for s in _live_storages(device_type).values())


class TensorMemoryTracker:
    """Current and peak bytes of tensor storages on one device type, for CPU runs where torch keeps no
    allocator statistics: the counterpart of torch.cuda.max_memory_allocated.

        with TensorMemoryTracker("cpu") as t:
            ...train a step...
        t.peak - t.baseline   # the most tensor memory the step added

    Storages created by torch operators are seen as they are made (a TorchDispatchMode) and forgotten when
    freed (a weakref finalizer; torch keeps one Python object per live storage). Tensors made outside the
    dispatcher (loaded from a checkpoint file) are picked up by `rescan()`, and at entry. Only the storages
    operators return are seen, not their scratch space; the overhead is a Python call per operator, fine
    for tiny models and a few steps.
    """

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self._sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.baseline = 0
        self._mode = None

    def _track(self, storage: torch.UntypedStorage) -> None:
        import weakref

        if storage.device.type != self.device_type:
            return
        key, size = id(storage), storage.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = size
            self.current += size
            weakref.finalize(storage, self._release, key)
        elif old != size:  # resized in place (ZeRO-3 frees and refills parameter storages)
            self._sizes[key] = size
            self.current += size - old
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def rescan(self) -> None:
        """Pick up storages made outside torch operators (e.g. weights read from a file)."""
        for storage in _live_storages(self.device_type).values():
            self._track(storage)

    def reset_peak(self) -> None:
        """Start a new peak from the current bytes."""
        self.peak = self.current

    def __enter__(self) -> TensorMemoryTracker:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    for inner in _plain_tensors(t):
                        try:
                            tracker._track(inner.untyped_storage())
                        except (RuntimeError, NotImplementedError):
                            pass
                return out

        self.rescan()
        self.baseline = self.peak = self.current
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
