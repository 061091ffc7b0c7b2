"""A text adapter on a Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration) leaves the vision
tower and the projector alone unless target_modules names them: peft's exclude_modules
(lorakit.model.adapter) and the planner's count of adapted layers (Arch.lora_targets) agree, layer for
layer, on a tiny checkpoint built as the hub's are."""

from __future__ import annotations

import pytest

from lorakit.model.families.multimodal import towers_left_alone
from lorakit.planner.arch import arch_from_config
from lorakit.recipe import recipe_from_dict
from lorakit.testing import build_tiny_gemma3_multimodal, tiny_config

VISION_Q = "vision_tower.encoder.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-mm")
    build_tiny_gemma3_multimodal(path)
    return path


def _peft_modules(path, target_modules) -> list[str]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.model.adapter import peft_config

    method = recipe_from_dict(
        {"model": {"name_or_path": str(path)}, "method": {"target_modules": target_modules},
         "data": {"source": "builtin:news_summaries"}, "output": {"dir": str(path / "out")}}
    ).method  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(path))
    peft = get_peft_model(model, peft_config(method, False, None, model))
    return sorted(
        n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
        for n, _ in peft.named_modules()
        if n.endswith(".lora_A.default")
    )


# (target_modules, adapted layers): 2 language layers x 7 linears; q and v of each; q of each and the
# tower's one q_proj, named.
@pytest.mark.parametrize(
    ("target_modules", "count"), [("all-linear", 14), (["q_proj", "v_proj"], 4), (["q_proj", VISION_Q], 3)]
)
def test_adapter_and_planner_leave_the_towers_alone_unless_named(checkpoint, target_modules, count):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(checkpoint))
    adapted = _peft_modules(checkpoint, target_modules)
    planned = sorted(lin.name for lin in arch_from_config(config).lora_targets(target_modules))
    assert adapted == planned
    vision = [n for n in adapted if ".vision_tower." in n]
    if VISION_Q in target_modules:
        # Named: the recipe asks for the tower, and peft matches the whole list there (SigLIP has q_proj).
        assert towers_left_alone(config, target_modules) == ("multi_modal_projector",)
        assert vision == ["model." + VISION_Q]
    else:
        assert towers_left_alone(config, target_modules) == ("vision_tower", "multi_modal_projector")
        assert not vision and all(".language_model.layers." in n for n in adapted)
    assert len(adapted) == count


def test_text_only_gemma3_has_no_towers():
    assert towers_left_alone(tiny_config("gemma3"), "all-linear") == ()
