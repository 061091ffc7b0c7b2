"""The tiled MLP (lorakit.model.tiled_mlp): the same outputs and gradients as the untiled model (fp32; LoRA,
full fine-tuning, gradient checkpointing, dropout), the same parameter names, and a peak of saved
activations that falls with the tile size."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lorakit.errors import RecipeError
from lorakit.model.tiled_mlp import LONG_ROW_TOKENS, TiledMLP, apply_tiled_mlp, tile_tokens
from lorakit.recipe import recipe_from_dict
from lorakit.testing import tiny_config
from tests.conftest import tiny_recipe_dict

# Not a divisor of the row: the last tile is shorter.
TILE = 16
ROW = 40


def _models(kind: str, method: str, checkpointing: bool):
    """(untiled, tiled) copies of one tiny causal model in fp32, with LoRA on every linear or fully
    trainable."""
    torch.manual_seed(0)
    config = tiny_config(kind)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(model, lora)
        # peft initialises B at 0: move it so that every LoRA gradient is non-trivial.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
    tiled = copy.deepcopy(model)
    assert apply_tiled_mlp(tiled, TILE) == config.num_hidden_layers
    return model.train(), tiled.train()


def _step(model, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


@pytest.mark.parametrize(
    "kind,method,checkpointing",
    [
        ("llama", "lora", False),
        ("qwen2", "lora", True),
        ("llama", "full", False),
    ],
)
def test_tiled_equals_untiled(kind, method, checkpointing):
    plain, tiled = _models(kind, method, checkpointing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, plain.config.vocab_size, (1, ROW), generator=g)
    weights = torch.randn(1, ROW, plain.config.vocab_size, generator=g)
    want_logits, want = _step(plain, ids, weights)
    got_logits, got = _step(tiled, ids, weights)
    assert torch.allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    mlp = [n for n in want if "mlp" in n]
    assert mlp and (len(want) == 21 if method == "full" else len(want) == 28)
    for name, w in want.items():
        scale = w.abs().max().item()
        assert scale > 0, name
        assert (got[name] - w).abs().max().item() <= 1e-5 * scale, name


def test_parameter_names_and_adapter_keys_are_unchanged():
    plain, tiled = _models("llama", "lora", False)
    assert list(plain.state_dict()) == list(tiled.state_dict())
    from peft import get_peft_model_state_dict

    assert list(get_peft_model_state_dict(plain)) == list(get_peft_model_state_dict(tiled))
    # The wrapper answers for the MLP's own attributes, and ZeRO-3 gathers its parameters once per call.
    mlp = tiled.base_model.model.model.layers[0].mlp
    assert isinstance(mlp, TiledMLP) and mlp.intermediate_size == plain.config.intermediate_size
    assert mlp._z3_leaf


def test_evaluation_tiles_without_a_graph():
    plain, tiled = _models("qwen2", "lora", False)
    ids = torch.randint(5, plain.config.vocab_size, (1, ROW), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = plain.eval()(input_ids=ids).logits
        got = tiled.eval()(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


class _DropoutMLP(nn.Module):
    def __init__(self, hidden: int = 16, wide: int = 64):
        super().__init__()
        self.up_proj = nn.Linear(hidden, wide)
        self.drop = nn.Dropout(0.5)
        self.down_proj = nn.Linear(wide, hidden)

    def forward(self, x):
        return self.down_proj(self.drop(torch.relu(self.up_proj(x))))


def test_backward_replays_the_forwards_dropout():
    """Each tile's recompute drops what its forward dropped: the gradients are those of the tiles run with
    a graph on the same random stream."""
    torch.manual_seed(0)
    mlp = _DropoutMLP().train()
    tiled = TiledMLP(copy.deepcopy(mlp), TILE).train()
    x = torch.randn(2, ROW, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(5)
    want = torch.cat([mlp(t) for t in x1.split(TILE, dim=-2)], dim=-2)
    want.square().sum().backward()
    torch.manual_seed(5)
    got = tiled(x2)
    # Random draws after the forward must not shift the replay.
    torch.rand(100)
    got.square().sum().backward()
    assert torch.equal(got, want)
    assert torch.allclose(x2.grad, x1.grad, atol=1e-6)
    for (name, p), q in zip(mlp.named_parameters(), tiled.parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, atol=1e-6), name


class _SavedBytes:
    """Bytes of the tensors autograd keeps for backward (saved activations), peak over a forward and
    backward: each saved storage counts once while some graph node holds it."""

    def __init__(self):
        self.holders: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if not self.holders.get(key):
            self.live += size
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1
        holder = _Holder(t)
        weakref.finalize(holder, self._drop, key, size)
        return holder

    def _drop(self, key: int, size: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            self.live -= size

    @staticmethod
    def unpack(holder):
        return holder.t


class _Holder:
    def __init__(self, t):
        self.t = t


class _GatedMLP(nn.Module):
    def __init__(self, hidden: int = 32, wide: int = 512):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, wide, bias=False)
        self.up_proj = nn.Linear(hidden, wide, bias=False)
        self.down_proj = nn.Linear(wide, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _peak_saved(mlp: nn.Module, x: torch.Tensor) -> int:
    saved = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        mlp(x).sum().backward()
    assert saved.live == 0
    return saved.peak


def test_the_activation_peak_falls_with_the_tile():
    torch.manual_seed(0)
    x = torch.randn(1, 512, 32, requires_grad=True)
    untiled = _peak_saved(_GatedMLP(), x)
    peaks = {tile: _peak_saved(TiledMLP(_GatedMLP(), tile), x) for tile in (256, 64, 16)}
    # Untiled: the 512 x 512 intermediates (gate, up, their activation) in fp32, about 3 MiB.
    assert untiled > 3 * 512 * 512 * 4
    assert untiled > peaks[256] > peaks[64] > peaks[16]
    # 32 tiles: the input, its tile's intermediates and the weights, under a tenth of the untiled peak.
    assert peaks[16] < untiled / 10


def tiny_llama_recipe(tmp_path, sp: int = 1, train: dict | None = None, **model):
    """A 2-process tiny:llama recipe with `model` keys (and `train` keys), for the tiling switches."""
    raw = tiny_recipe_dict(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama", **model},
        data={"format": "instruction", "max_length": 512},
        distributed={"num_processes": 2, "sequence_parallel": sp},
        train=train or {},
    )
    return recipe_from_dict(raw)


def test_the_tile_size_the_recipe_asks_for(tmp_path):
    config = tiny_config("llama")
    # auto, short rows, no sequence parallelism
    assert tile_tokens(tiny_llama_recipe(tmp_path), config) is None
    assert tile_tokens(tiny_llama_recipe(tmp_path, sp=2), config) == config.hidden_size
    assert tile_tokens(tiny_llama_recipe(tmp_path, sp=2, tiled_mlp=False), config) is None
    assert tile_tokens(tiny_llama_recipe(tmp_path, tiled_mlp=True, mlp_tile_tokens=100), config) == 100
    long = recipe_from_dict(
        {
            **tiny_recipe_dict(tmp_path, tmp_path / "r", model={"name_or_path": "tiny:llama"}),
            "train": {"max_tokens": LONG_ROW_TOKENS},
        }
    )
    assert tile_tokens(long, config) == config.hidden_size
    with pytest.raises(RecipeError, match="encoder-decoder"):
        tile_tokens(tiny_llama_recipe(tmp_path, tiled_mlp=True), tiny_config("t5"))
    with pytest.raises(RecipeError, match="mlp_tile_tokens"):
        tiny_llama_recipe(tmp_path, tiled_mlp=False, mlp_tile_tokens=64)
