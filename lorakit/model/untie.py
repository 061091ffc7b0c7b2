"""Restore an output head that ZeRO-3 loading wrongly tied to the input embeddings.

transformers 5.x (seen on 5.23) ties `lm_head.weight` to the shared embeddings during from_pretrained when
the config asks for tying, unless both are in the checkpoint with different values. T5Config now always
asks for tying (it turns `tie_word_embeddings: false` into `scale_decoder_outputs: false`), and under
ZeRO-3 the "different values" check compares empty partitioned tensors, which look equal. So FLAN-T5, whose
head is separate, silently loses it under ZeRO-3 and trains and generates with its embedding matrix as the
head. Plain (non-ZeRO) loading is right. We repair it at the call site, and tests/integration/
test_zero3_loading.py fails if either the upstream behaviour or our repair changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def hpz_group_of_earlier_init() -> dict:
    """zero.Init's arguments for a second partitioned init in a process: the ZeRO++ hpZ group (distributed.
    hpz_partition_size) that the first one made. Upstream, each zero.Init under zero_hpz_partition_size > 1
    creates that group and a second one fails with "ZeRO parameter intra parallel group is already
    initialized" (DeepSpeed issues #4901, #7066; PR #8361 would reuse it); handing it the group is
    zero.Init's own `zero_param_parallel_group` argument. tests/integration/test_methods.py trains a tiny T5
    (whose separate head is restored here under a second zero.Init) with hpZ."""
    from deepspeed.utils import groups

    group = groups._get_zero_param_intra_parallel_group()
    return {} if group is None else {"zero_param_parallel_group": group}


def _module_key(model: torch.nn.Module, module: torch.nn.Module) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return f"{name}.weight" if name else "weight"
    return None


def _checkpoint_file(source: str, filename: str, revision: str | None) -> Path | None:
    local = Path(source).expanduser()
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    from transformers.utils import cached_file

    found = cached_file(source, filename, revision=revision, _raise_exceptions_for_missing_entries=False)
    return Path(found) if found else None


def checkpoint_tensors(source: str, keys: list[str], revision: str | None = None) -> dict[str, torch.Tensor]:
    """The named tensors from a model's safetensors checkpoint (sharded or not); missing keys are absent."""
    from safetensors import safe_open

    index = _checkpoint_file(source, "model.safetensors.index.json", revision)
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: weight_map[k] for k in keys if k in weight_map}
    else:
        files = dict.fromkeys(keys, "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, filename in files.items():
        path = _checkpoint_file(source, filename, revision)
        if path is None:
            continue
        with safe_open(str(path), framework="pt") as f:
            if key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def restore_untied_head(model, source: str, revision: str | None, ds_config: dict) -> bool:
    """If ZeRO-3 loading tied a head that the checkpoint keeps separate, give it back its own weights.

    Returns True when a head was restored. Every rank must call this (parameter creation is collective).
    """
    import deepspeed
    import torch.distributed as dist

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head_key, embed_key = _module_key(model, head), _module_key(model, embed)
    main = not dist.is_initialized() or dist.get_rank() == 0
    tensors = checkpoint_tensors(source, [head_key, embed_key], revision) if main else {}
    separate = (
        head_key in tensors
        and embed_key in tensors
        and not torch.equal(tensors[head_key], tensors[embed_key])
    )
    if dist.is_initialized():
        box = [separate]
        dist.broadcast_object_list(box, src=0)
        separate = box[0]
    if not separate:
        return False
    shape = tuple(getattr(embed.weight, "ds_shape", embed.weight.shape))
    with deepspeed.zero.Init(config_dict_or_path=ds_config, **hpz_group_of_earlier_init()):
        new_head = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=embed.weight.dtype)
    with deepspeed.zero.GatheredParameters([new_head.weight], modifier_rank=0):
        if main:
            new_head.weight.data.copy_(tensors[head_key].to(new_head.weight.dtype))
    model.set_output_embeddings(new_head)
    # Keep transformers from re-tying it on a later internal tie_weights(recompute_mapping=False).
    getattr(model, "all_tied_weights_keys", {}).pop(head_key, None)
    return True
