"""The streaming merge's plan and math: which checkpoint tensor each LoRA module changes, by how much, and
the check that every merged tensor is W + scale * B A.

Only the base's headers and a model skeleton on the meta device are read to plan; the merge then holds one
tensor at a time (in float32 while it is merged) plus the adapter. Adapters whose merge is not "add
scale * B A to one weight" (DoRA, modules_to_save, embedding or bias LoRA, fan_in_fan_out, tied weights,
tensors converted on loading, quantized checkpoints) raise CannotStream, and the caller merges in memory
with peft instead. Checkpoints whose keys transformers renames on loading (Gemma 3's language_model.model.*,
vision_tower.vision_model.*) are read through transformers' own conversion mapping (renamed_keys).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorakit.export.adapter import Adapter, check_fits
from lorakit.export.shards import Entry, checkpoint_files, nbytes, read_entries
from lorakit.export.sources import MergeSource

# adapter_config.json entries that make a merge more than W + scale * B A on one weight.
_NOT_PER_TENSOR = (
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
    "alora_invocation_tokens",
)


class CannotStream(Exception):
    """This merge cannot be done shard by shard; the message says why."""


@dataclass(frozen=True)
class Delta:
    """One LoRA module's change to one checkpoint tensor: W + scale * (B @ A)."""

    module: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class StreamPlan:
    """What the streaming merge writes: every base tensor in order, its output dtype, and its delta."""

    base_dir: Path
    entries: list[Entry]
    out_dtypes: dict[str, torch.dtype]
    deltas: dict[str, Delta]
    model_class: str
    can_generate: bool
    # The config ties the embeddings, but the checkpoint holds both with different values, so transformers
    # loads them apart; the export's config says so (as peft's merge_and_unload writes it).
    untie: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def items(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(key, shape, output dtype) of every output tensor, in order."""
        return [(e.key, e.shape, self.out_dtypes[e.key]) for e in self.entries]

    @property
    def output_bytes(self) -> int:
        """Size of the merged model's weights."""
        return sum(nbytes(s, d) for _, s, d in self.items)


def plan(src: MergeSource, adapter: Adapter | None, auto_cls, config, dtype: str) -> StreamPlan:
    """Read the base's headers and a meta-device skeleton of the model, map every adapted module to its
    checkpoint tensor; raises CannotStream when the merge is not per tensor, AdapterError when the adapter
    does not fit the base."""
    if getattr(config, "quantization_config", None):
        raise CannotStream("the base checkpoint is quantized")
    if adapter is not None:
        _check_supported(adapter)
    base_dir = _base_directory(src)
    files = checkpoint_files(base_dir)
    if not files:
        raise CannotStream(f"the base ({base_dir}) has no safetensors files")
    entries = read_entries(files)
    with torch.device("meta"):
        skeleton = auto_cls.from_config(config, trust_remote_code=src.trust_remote_code)
    deltas: dict[str, Delta] = {}
    if adapter is not None:
        check_fits(adapter, skeleton, src.base_name)
        deltas = _deltas(adapter, skeleton, {e.key: e for e in entries})
    torch_dtype = getattr(torch, dtype)
    keep_fp32 = _keep_in_fp32(skeleton, torch_dtype)
    out_dtypes = {
        e.key: (
            e.dtype
            if not e.dtype.is_floating_point
            else torch.float32
            if keep_fp32 is not None and keep_fp32.search(e.key)
            else torch_dtype
        )
        for e in entries
    }
    can_generate = bool(getattr(skeleton, "can_generate", lambda: False)())
    untie = bool(getattr(config, "tie_word_embeddings", False)) and _stored_apart(skeleton, entries)
    return StreamPlan(base_dir, entries, out_dtypes, deltas, type(skeleton).__name__, can_generate, untie)


def _stored_apart(skeleton, entries: list[Entry]) -> bool:
    """Whether a tied pair is stored twice with different values (transformers then does not tie it)."""
    from lorakit.export.shards import Reader

    by_key = {e.key: e for e in entries}
    tied = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    reader = Reader()
    try:
        for target, source in tied.items():
            if target in by_key and source in by_key:
                if not torch.equal(reader.get(by_key[target]), reader.get(by_key[source])):
                    return True
    finally:
        reader.close()
    return False


def _check_supported(adapter: Adapter) -> None:
    if adapter.vectors:
        raise CannotStream("IA3 merges through peft")
    used = [k for k in _NOT_PER_TENSOR if adapter.config.get(k)]
    if used:
        raise CannotStream(f"the adapter uses {', '.join(used)}, whose merge is not W + scale * B A")
    paired = {f"{m}.lora_{s}.weight" for m in adapter.pairs for s in "AB"}
    other = sorted(k for k in adapter.tensors if k.removeprefix("base_model.model.") not in paired)
    if other:
        raise CannotStream(
            f"the adapter holds tensors other than LoRA matrices of linear layers ({other[0]})"
        )


def _base_directory(src: MergeSource) -> Path:
    """The directory holding the base's safetensors: a local path, or the hub snapshot (from the cache, or
    fetched as from_pretrained would)."""
    p = Path(src.base_source)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                src.base_source, revision=src.revision, allow_patterns=["*.safetensors", "*.json"]
            )
        )
    except Exception as e:  # noqa: BLE001 - any failure means "merge in memory instead"
        raise CannotStream(f"cannot fetch the base's files ({e})") from e


def lora_scale(config: dict, module: str, rank: int) -> float:
    """peft's scaling of one module: alpha / r (alpha / sqrt(r) with rsLoRA), with rank_pattern and
    alpha_pattern applied as peft applies them."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r = ranks.get(get_pattern_key(list(ranks), module), config["r"])
    alpha = alphas.get(get_pattern_key(list(alphas), module), config["lora_alpha"])
    if r != rank:
        raise CannotStream(f"{module}: lora_A has rank {rank}, the adapter config says {r}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def checkpoint_key(model_key: str, keys: set[str], prefix: str) -> str | None:
    """The checkpoint key of a model parameter: the same name, or with the base model prefix dropped or
    added (checkpoints of the bare model, e.g. `layers.0...` for `model.layers.0...`)."""
    candidates = [model_key]
    if prefix and model_key.startswith(prefix + "."):
        candidates.append(model_key[len(prefix) + 1 :])
    if prefix:
        candidates.append(f"{prefix}.{model_key}")
    return next((k for k in candidates if k in keys), None)


def renamed_keys(skeleton, keys) -> tuple[dict[str, str], set[str]]:
    """How transformers loads the checkpoint `keys` into `skeleton`: ({model parameter name: checkpoint key}
    for every key its checkpoint conversion mapping renames, e.g. Gemma 3's language_model.model.layers.* ->
    model.language_model.layers.*), and the keys one of its converters rewrites (merged, split or reshaped
    on loading: no one-to-one tensor to merge into). The mapping is transformers' own
    (conversion_mapping.get_model_conversion_mapping, which from_pretrained applies and save_pretrained
    reverses), so the streaming merge reads the names as loading does."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings loads keys as they are
        return {}, set()
    conversions = get_model_conversion_mapping(skeleton)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = dict(skeleton.state_dict())
    prefix = getattr(skeleton, "base_model_prefix", None) or None
    renamed, converted = {}, set()
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is not None:
            converted.add(key)
        elif name != key:
            renamed[name] = key
    return renamed, converted


def _deltas(adapter: Adapter, skeleton, entries: dict[str, Entry]) -> dict[str, Delta]:
    tied = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    tied_names = set(tied) | set(tied.values())
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    renamed, converted = renamed_keys(skeleton, entries)
    deltas = {}
    for module, (a, b) in sorted(adapter.pairs.items()):
        model_key = f"{module}.weight"
        if model_key in tied_names:
            raise CannotStream(f"{module} is a tied weight (its merge changes every weight tied to it)")
        key = renamed.get(model_key) or checkpoint_key(model_key, set(entries), prefix)
        if key in converted:
            raise CannotStream(f"{key} is converted on loading (not one tensor of the model's {model_key})")
        if key is None:
            raise CannotStream(f"{model_key} has no tensor of that name in the base checkpoint (renamed)")
        shape = entries[key].shape
        if shape != (b.shape[0], a.shape[1]):
            raise CannotStream(f"{key} is stored as {shape}, not (out, in) = {(b.shape[0], a.shape[1])}")
        deltas[key] = Delta(module, a, b, lora_scale(adapter.config, module, a.shape[0]))
    return deltas


def _keep_in_fp32(skeleton, torch_dtype: torch.dtype) -> re.Pattern | None:
    """Keys transformers keeps in float32 when it loads the model in `torch_dtype` (T5's `wo` in float16),
    as a pattern searched in each key, as transformers searches it."""
    keep = set()
    if torch_dtype == torch.float16:
        keep |= set(getattr(skeleton, "_keep_in_fp32_modules", None) or ())
    if torch_dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(skeleton, "_keep_in_fp32_modules_strict", None) or ())
    if not keep:
        return None
    return re.compile("|".join(k.replace("*", ".*") for k in sorted(keep)))


def merge_tensor(w: torch.Tensor, delta: Delta) -> torch.Tensor:
    """W + (B @ A) * scale in float32, as peft computes it (so float32 merges are identical to peft's), in
    place in a float32 copy of W: two tensors of W's size at the peak. Always a copy: safetensors hands out
    tensors backed by its private file mapping, and pages written there stay in memory (copy-on-write)
    until the file is closed, so merging in place would hold a whole base shard."""
    merged = w.to(torch.float32, copy=True)
    product = delta.b.float() @ delta.a.float()
    product.mul_(delta.scale)
    return merged.add_(product)


# Rows per block of the |matrix| @ |x| products, so no full-size temporary is made for them.
_ROWS = 1024


def _abs_matvec(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([m[i : i + _ROWS].float().abs() @ x for i in range(0, m.shape[0], _ROWS)])


@dataclass
class Probe:
    """W's side of the residual check, taken before W is merged in place: W x and |W| |x|."""

    x: torch.Tensor
    wx: torch.Tensor
    w_mag: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor, gen: torch.Generator) -> Probe:
        """Probe `w` with a random vector from `gen`."""
        x = torch.randn(w.shape[1], generator=gen)
        return cls(
            x,
            torch.cat([w[i : i + _ROWS].float() @ x for i in range(0, w.shape[0], _ROWS)]),
            _abs_matvec(w, x.abs()),
        )

    def residual(self, out: torch.Tensor, delta: Delta) -> float:
        """How far the stored tensor `out` is from W + scale * B A, as a fraction of what rounding allows.

        |out x - (W x + scale B (A x))| per row, against the rounding of storing in out's dtype (its epsilon
        x |out| |x|) plus float32 dot products (n eps32 x the terms' magnitudes). At most 1 passes; a delta
        left out, added twice or to the wrong tensor lands far above."""
        a, b, x = delta.a.float(), delta.b.float(), self.x
        ax = x.abs()
        want = self.wx + delta.scale * (b @ (a @ x))
        magnitude = self.w_mag + abs(delta.scale) * (b.abs() @ (a.abs() @ ax))
        got = torch.cat([out[i : i + _ROWS].float() @ x for i in range(0, out.shape[0], _ROWS)])
        out_mag = _abs_matvec(out, ax)
        eps32 = torch.finfo(torch.float32).eps
        bound = torch.finfo(out.dtype).eps * out_mag + (x.numel() + a.shape[0] + 4) * eps32 * (
            magnitude + out_mag
        )
        err = (got - want).abs()
        if not torch.isfinite(err).all():
            return math.inf
        return float((err / bound.clamp_min(torch.finfo(torch.float32).tiny)).max())
