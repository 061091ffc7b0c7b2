"""The tiled loss (lorakit.model.tiled_loss): the same token-weighted loss and gradients as logits through the
chunked cross-entropy (fp32; LoRA, LoRA on the head, full fine-tuning with a separate and a tied head), the
same parameter names, a memory peak that no longer grows with tokens x vocabulary, and the recipe keys."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorakit.errors import RecipeError
from lorakit.meter import TensorMemoryTracker
from lorakit.model.loss import token_loss_sum
from lorakit.model.tiled_loss import LOSS_TILE_ELEMENTS, TiledLossHead, apply_tiled_loss, loss_tile_tokens
from lorakit.model.tiled_mlp import LONG_ROW_TOKENS
from lorakit.recipe import recipe_from_dict
from lorakit.testing import tiny_config
from tests.conftest import tiny_recipe_dict
from tests.unit.test_tiled_mlp import tiny_llama_recipe

# Not a divisor of the row: the last tile is shorter.
TILE = 16
ROW = 45


def _models(kind: str, method: str, tile: int = TILE, **config_overrides):
    """(untiled, tiled) copies of one tiny causal model in fp32: LoRA on every linear (`lora`), also on the
    head (`lora-head`), or fully trainable (`full`)."""
    torch.manual_seed(0)
    config = tiny_config(kind)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if method.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "down_proj"] + (["lm_head"] if method == "lora-head" else [])
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        # peft initialises B at 0: move it so that every LoRA gradient is non-trivial.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
    tiled = copy.deepcopy(model)
    head = apply_tiled_loss(tiled, tile)
    assert isinstance(head, TiledLossHead) and tiled.get_output_embeddings() is head
    return model.train(), tiled.train(), head


def _batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (2, ROW), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, :7] = -100  # a prompt without loss
    labels[1, -3:] = -100
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "kind,method",
    [("llama", "lora"), ("llama", "lora-head"), ("llama", "full"), ("qwen2", "full")],
)
def test_tiled_loss_equals_the_untiled_loss(kind, method):
    plain, tiled, head = _models(kind, method)
    # The wrapper keeps the head's parameter names (state dicts, adapters, checkpoints), and Qwen2's tie.
    assert list(plain.state_dict()) == list(tiled.state_dict())
    assert (head.weight is tiled.get_input_embeddings().weight) == (kind == "qwen2")
    assert head._z3_leaf and head.out_features == plain.config.vocab_size
    ids, labels = _batch(plain.config.vocab_size)
    want = token_loss_sum(plain(input_ids=ids, use_cache=False).logits, labels)
    # A scale other than 1, as the loop's token weighting applies.
    (want * 0.37).backward()
    with head.targets(labels):
        losses = tiled(input_ids=ids, use_cache=False).logits
    assert losses.shape == labels.shape and losses.dtype == torch.float32
    assert bool((losses[labels == -100] == 0).all()) and bool((losses[labels != -100] > 0).all())
    got = losses.sum()
    (got * 0.37).backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    want_g, got_g = _grads(plain), _grads(tiled)
    assert got_g.keys() == want_g.keys()
    heads = [n for n in want_g if "lm_head" in n or "embed_tokens" in n]
    # The head's gradients are in the comparison: its weight (full fine-tuning; Qwen2's is tied to the
    # input embeddings), or its LoRA weights.
    assert bool(heads) == (method != "lora"), heads
    for name, w in want_g.items():
        scale = w.abs().max().item()
        assert scale > 0, name
        assert (got_g[name] - w).abs().max().item() <= 1e-5 * scale, name
    # Outside `targets`, the wrapper is the head: generation and logits-based evaluation are unchanged.
    with torch.no_grad():
        assert torch.allclose(tiled(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)


def _peak(head: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, tiled: bool) -> int:
    """Peak tensor bytes a forward and backward of the head and loss add to `x` and the head's weight."""
    x = x.clone().requires_grad_()
    with TensorMemoryTracker("cpu") as t:
        if tiled:
            with head.targets(labels):
                loss = head(x).sum()
        else:
            loss = token_loss_sum(head(x), labels)
        loss.backward()
        del loss
        return t.peak - t.baseline


def test_the_memory_peak_no_longer_grows_with_tokens_times_vocabulary():
    """The head and loss of a row (hidden 16, vocabulary 4096, fp32, the head frozen as with LoRA):
    untiled, every token adds its logits, their gradient and fp32 working copies; tiled, only
    hidden-state-wide tensors (the gradient of the hidden states), so a 4 times longer row peaks at about
    the same bytes: one tile's logits."""
    hidden, vocab, tile = 16, 4096, 32
    torch.manual_seed(0)
    linear = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    wrapped = TiledLossHead(copy.deepcopy(linear), tile)
    peaks = {}
    for tokens in (64, 256):
        x = torch.randn(1, tokens, hidden)
        labels = torch.randint(0, vocab, (1, tokens))
        peaks["plain", tokens] = _peak(linear, x, labels, tiled=False)
        peaks["tiled", tokens] = _peak(wrapped, x, labels, tiled=True)
    grow = {name: (peaks[name, 256] - peaks[name, 64]) / 192 for name in ("plain", "tiled")}
    assert grow["plain"] >= 3 * 4 * vocab
    assert grow["tiled"] <= 4 * 4 * hidden
    # Tiled: a few tile x vocabulary tensors.
    assert peaks["tiled", 256] <= 6 * 4 * tile * vocab
    assert peaks["tiled", 256] < peaks["plain", 256] / 5


def test_the_loss_tile_the_recipe_asks_for(tmp_path):
    config = tiny_config("llama")
    default = LOSS_TILE_ELEMENTS // config.vocab_size
    # auto, short rows, no sequence parallelism
    assert loss_tile_tokens(tiny_llama_recipe(tmp_path), config) is None
    assert loss_tile_tokens(tiny_llama_recipe(tmp_path, sp=2), config) == default
    assert loss_tile_tokens(tiny_llama_recipe(tmp_path, sp=2, tiled_loss=False), config) is None
    assert loss_tile_tokens(tiny_llama_recipe(tmp_path, tiled_loss=True, loss_tile_tokens=100), config) == 100
    long = tiny_llama_recipe(tmp_path, train={"max_tokens": LONG_ROW_TOKENS})
    assert loss_tile_tokens(long, config) == default
    # auto leaves alone a family whose logits are more than the head's output.
    gemma2 = copy.deepcopy(config)
    gemma2.model_type = "gemma2"
    assert loss_tile_tokens(tiny_llama_recipe(tmp_path, sp=2), gemma2) is None
    with pytest.raises(RecipeError, match="gemma2"):
        loss_tile_tokens(tiny_llama_recipe(tmp_path, tiled_loss=True), gemma2)
    with pytest.raises(RecipeError, match="'t5'"):
        loss_tile_tokens(tiny_llama_recipe(tmp_path, tiled_loss=True), tiny_config("t5"))
    with pytest.raises(RecipeError, match="loss_tile_tokens"):
        tiny_llama_recipe(tmp_path, tiled_loss=False, loss_tile_tokens=64)


def test_dpo_refuses_a_forced_tiled_loss(tmp_path):
    raw = tiny_recipe_dict(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama", "tiled_loss": True},
        data={"format": "instruction", "max_length": 64},
        train={"objective": "dpo"},
        eval={"generate": False},
    )
    with pytest.raises(RecipeError, match="model.tiled_loss"):
        recipe_from_dict(raw)
    raw["model"]["tiled_loss"] = "auto"
    raw["distributed"]["num_processes"] = 1
    # auto never tiles DPO, however long its rows.
    raw["train"]["max_tokens"] = LONG_ROW_TOKENS
    assert loss_tile_tokens(recipe_from_dict(raw), tiny_config("llama")) is None
