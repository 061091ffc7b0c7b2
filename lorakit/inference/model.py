"""A trained model to run: what SOURCE is (a run directory, an adapter directory or a model directory, found
as lorakit.merge finds it), the recipe and label words it was trained with, and the model loaded the way
training held it."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit.errors import InferenceError, MergeError
from lorakit.export.sources import MergeSource, locate, read_recipe_text
from lorakit.recipe import Recipe

SOURCES_DOC = "docs/inference.md#sources"
OPTIONS_DOC = "docs/inference.md#generate"


@dataclass(frozen=True)
class Trained:
    """What is known about a trained model before loading it."""

    source: MergeSource
    # The recipe it was trained with (None: unknown, prompts are used as given) and where it was found.
    recipe: Recipe | None
    recipe_from: str | None
    # The label words of a classifier run (summary.json data.labels, or the export's model card).
    labels: list[str] | None
    summary: dict[str, Any] | None

    @property
    def run_dir(self) -> Path | None:
        """The run directory, when SOURCE is one or lies in one."""
        return self.source.run_dir

    def describe(self) -> str:
        """One line: what is run, and which template its prompts get."""
        src = self.source
        what = "adapter" if src.kind == "adapter" else "model"
        line = f"{what} {src.path}" + (f" on {src.base_name}" if src.kind == "adapter" else "")
        if self.recipe is None:
            return line + "; no recipe found, so inputs are used as given (no prompt template)"
        return line + f", trained with the recipe in {self.recipe_from}"


def find_trained(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_code: Collection[str] = (),
) -> Trained:
    """Find what `path` is and what it was trained with, without loading any weights. InferenceError when it
    is no run directory, adapter directory or model directory. trust_remote_code, allow_pickle: the caller's;
    the recipe found there never grants them (refused when it asks for them), and imports only the modules
    of `allow_code` (recipe/read_back.py)."""
    grants = {"trust_remote_code": trust_remote_code, "allow_pickle": allow_pickle, "allow_code": allow_code}
    try:
        src = locate(path, **grants)
    except MergeError as e:
        raise InferenceError(str(e), doc=SOURCES_DOC) from e
    labels = ((src.summary or {}).get("data") or {}).get("labels")
    if src.recipe is not None:
        return Trained(src, src.recipe, f"the run directory {src.run_dir}", labels, src.summary)
    from lorakit.export.card import CARD, read_card

    # A merged export outside its run directory carries the run's recipe in its model card.
    card = read_card(src.path)
    if card.recipe_text is None:
        return Trained(src, None, None, card.labels, None)
    where = src.path / CARD
    recipe = read_recipe_text(
        card.recipe_text,
        where,
        grants,
        lambda e: InferenceError(
            f"{where}: the recipe in the model card cannot be read: {e}", doc=SOURCES_DOC
        ),
    )
    return Trained(src, recipe, f"the model card {src.path / CARD}", card.labels, None)


def pick_device(device: str | None = None):
    """`device` as a torch.device; None: the GPU when there is one, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        where = torch.device(device)
    except RuntimeError as e:
        raise InferenceError(f"--device {device!r}: {e}", doc=OPTIONS_DOC) from e
    if where.type == "cuda" and not torch.cuda.is_available():
        raise InferenceError(f"--device {device!r}: this machine has no CUDA GPU", doc=OPTIONS_DOC)
    return where


class LoadedModel:
    """A trained model on its device, in eval mode, with its tokenizer and config.

    It is a lorakit.evaluation.generate.EvalModel, as training's Engine is: `.module`, `.device`, and a
    forward."""

    def __init__(self, model, tokenizer, config, device, dtype, attention: str):
        from lorakit.model.inputs import ModelInputs

        self.module, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        self.dtype, self.attention = dtype, attention
        self.is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        # Eval batches are padded, never packed: the plain backend's masks, as in training's eval.
        self.inputs = ModelInputs(config, attention, dtype)

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    @contextlib.contextmanager
    def generation_weights(self):
        """Whole: one process holds the model."""
        yield True


def load_model(
    trained: Trained,
    *,
    recipe: Recipe | None = None,
    device: str | None = None,
    dtype: str | None = None,
    tokenizer=None,
) -> LoadedModel:
    """Load `trained` for inference on `device` (default: GPU if any, else CPU).

    recipe: the recipe to load it with (default: the one it was trained with). dtype: bfloat16 | float16 |
    float32 (default: the recipe's model.dtype; without a recipe, the dtype the weights were saved in).
    Adapters of QLoRA runs go on the base quantized as in training. tokenizer: the one to use (default:
    the one saved with the adapter or model, else the base's)."""
    import torch

    from lorakit.export.loading import auto_model_class, load_pretrained
    from lorakit.model.attention import choose_attention
    from lorakit.model.cpu_products import use_fp32_products
    from lorakit.model.families.unknown import loadable_class

    src = trained.source
    recipe = recipe or trained.recipe
    dtype = dtype or (recipe.model.dtype if recipe is not None else None)
    if dtype not in (None, "bfloat16", "float16", "float32"):
        raise InferenceError(f"--dtype {dtype!r}: choose bfloat16, float16 or float32", doc=OPTIONS_DOC)
    torch_dtype = getattr(torch, dtype) if dtype else "auto"
    where = pick_device(device)
    auto_cls, config = auto_model_class(src)
    requested = recipe.model.attention if recipe is not None else "auto"
    model_cls = loadable_class(config, src.trust_remote_code)[1]
    # A model class transformers does not map (remote code): its own default.
    attention = choose_attention(requested, model_cls) if model_cls is not None else None
    kwargs: dict[str, Any] = {"attn_implementation": attention} if attention else {}
    quantized = src.kind == "adapter" and recipe is not None and recipe.method.quantization()
    if quantized:
        from lorakit.model.quantize import bnb_config, require_bitsandbytes

        require_bitsandbytes()
        kwargs["quantization_config"] = bnb_config(recipe.method.quantization(), getattr(torch, dtype))
    model = load_pretrained(auto_cls, src.base_source, torch_dtype, src, **kwargs)
    if quantized:
        from lorakit.model.quantize import keep_standard_4bit_layout

        keep_standard_4bit_layout(model)  # the layout it trained in
    if src.kind == "adapter":
        import warnings

        from peft import PeftModel

        with warnings.catch_warnings():
            # peft 0.21 (PeftModel.__init__) reads transformers' deprecated `is_gradient_checkpointing`.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(src.path), is_trainable=False)
    if dtype is not None:
        # What training evaluated: DeepSpeed's bf16/fp16 engine holds every floating parameter in that
        # dtype (the layers transformers keeps in fp32, such as T5's `wo`, and peft's LoRA weights too).
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch_dtype:
                p.data = p.data.to(torch_dtype)
    model.to(where).eval()
    tokenizer = tokenizer or _tokenizer(src)
    compute = torch_dtype if dtype else model.dtype
    # As training computed on this CPU: bf16 products formed in fp32 where it has no fast bf16 kernel.
    use_fp32_products(model, compute, where.type)
    return LoadedModel(model, tokenizer, config, where, compute, attention or "eager")


def _tokenizer(src: MergeSource):
    from transformers import AutoTokenizer

    where = src.tokenizer_source()
    tok = AutoTokenizer.from_pretrained(
        where,
        revision=src.revision if where == src.base_source else None,
        trust_remote_code=src.trust_remote_code,
    )
    if tok.pad_token_id is None:
        # As in training (lorakit.model.build.load_tokenizer): padding is masked, so EOS is a safe stand-in.
        tok.pad_token = tok.eos_token
    return tok
