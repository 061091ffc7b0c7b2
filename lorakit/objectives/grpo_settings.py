"""The grpo objective's settings (the recipe's grpo section): group relative policy optimisation, online RL
with rewards computed on completions sampled from the policy being trained. Torch-free, as dpo_settings.py.

Rows are prompts (lorakit.data.prompts): data.format instruction (data.input_column through
data.prompt_template) or chat (data.messages_column: the prompt as text or messages, through the chat
template), with an optional reference-answer column the rewards may compare against.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from lorakit.recipe.objective_spec import ObjectiveSpec
from lorakit.recipe.section import Section

# Built-in rewards (lorakit.objectives.rewards); anything else is a user function `module:function`.
BUILT_IN_REWARDS = ("exact_match", "math", "regex", "length")
# Those that read the row's reference answer (grpo.answer_column).
ANSWER_REWARDS = ("exact_match", "math")

# grpo.loss, each aggregation once: what it does (the field's description) and the divisor of a step's sum
# of token losses (GrpoObjective.units; lorakit.objectives.grpo_loss.policy_loss computes it).
AGGREGATIONS = {
    "grpo": ("averages each completion's tokens, then the completions", "completions"),
    "dapo": ("averages over every completion token of the batch", "completion tokens"),
    "dr_grpo": (
        "sums tokens over completions x max_new_tokens (Dr. GRPO's constant, no length bias)",
        "completions x max_new_tokens",
    ),
}


def _aggregations() -> str:
    return "Aggregation: " + "; ".join(f"{name} {what}" for name, (what, _) in AGGREGATIONS.items()) + "."


class RewardEntry(Section):
    """One reward function and its weight; the rewards of a completion are weighted and summed."""

    name: str = Field(
        description="exact_match (the completion's last line equals the row's answer, stripped), math (the "
        "answer checked with math-verify; extra lorakit[rl]), regex (1 when grpo.rewards[].pattern matches), "
        "length (1 at `target` completion tokens, falling linearly to 0 at 0 and 2 x target), or a user "
        "function `module:function` called as fn(completion, row) -> number."
    )
    weight: float = Field(1.0, description="The reward's weight in the sum.")
    pattern: str | None = Field(None, description="regex: the pattern searched for (Python re, DOTALL).")
    target: int | None = Field(None, gt=0, description="length: the completion length (tokens) scored 1.")

    def is_function(self) -> bool:
        """Whether the entry names user code (`module:function`)."""
        return self.name not in BUILT_IN_REWARDS

    @model_validator(mode="after")
    def _check(self) -> RewardEntry:
        name = self.name
        if name not in BUILT_IN_REWARDS:
            module, colon, fn = name.partition(":")
            if not colon or not module.strip() or not fn.strip().isidentifier():
                raise ValueError(
                    f"reward {name!r}: neither a built-in ({', '.join(BUILT_IN_REWARDS)}) nor `module:function`"
                )
        if (name == "regex") != (self.pattern is not None):
            raise ValueError(f"reward {name!r}: `pattern` is the regex reward's (and it needs one)")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward regex: pattern {self.pattern!r} is not a regex: {e}") from None
        if (name == "length") != (self.target is not None):
            raise ValueError(f"reward {name!r}: `target` is the length reward's (and it needs one)")
        return self


class GrpoSection(Section):
    """Group relative policy optimisation (train.objective: grpo; Shao et al. 2024): for every prompt the
    policy samples num_generations completions, rewards score them, each completion's advantage is its reward
    less the group's mean (over the group's spread unless scale_rewards is false), and the clipped
    policy-ratio loss raises the likelihood of the better ones."""

    answer_column: str | None = Field(
        None, description="Column with the row's reference answer (exact_match and math read it); None: none."
    )
    num_generations: int = Field(4, ge=2, description="G: completions sampled per prompt (one group).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the rollouts (1: off).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion sampled (tokens).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clip range of the policy ratio: [1 - eps, 1 + eps].")
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference (the base with the adapter switched off; k3 estimator). "
        "0: no reference pass.",
    )
    loss: Literal[tuple(AGGREGATIONS)] = Field("dapo", description=_aggregations())
    scale_rewards: bool = Field(
        True, description="Divide advantages by the group's reward std (Dr. GRPO: false, no difficulty bias)."
    )
    passes: int = Field(
        1, ge=1, description="Optimisation passes over each batch of rollouts (ratio != 1 after the first)."
    )
    rewards: list[RewardEntry] = Field(min_length=1, description="Reward functions, weighted and summed.")
    rollout_engine: Literal["engine", "vllm"] = Field(
        "engine",
        description="What generates the rollouts: engine (the training Engine's own generate, every backend, "
        "CPU too) or vllm (extra lorakit[vllm], CUDA, causal LMs; vLLM is sent only the adapter each step).",
    )
    vllm_server: str | None = Field(
        None,
        description="rollout_engine vllm: URL of a vLLM server (vllm serve BASE --enable-lora, with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) that is sent the adapter and the prompts; None: a vLLM engine "
        "colocated with each training process, asleep while it trains.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="Colocated vLLM: the share of its GPU's memory it may take."
    )

    @classmethod
    def named_code(cls, raw: Any) -> dict[str, str]:
        """{field: `module:function`} of the user code a raw (unvalidated) grpo section names: the recipe's
        trust rule (lorakit.recipe.read_back) asks the registry for it."""
        entries = raw.get("rewards") if isinstance(raw, dict) else None
        found = {}
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            name = entry.get("name") if isinstance(entry, dict) else None
            if isinstance(name, str) and ":" in name:
                found[f"rewards[{i}].name"] = name
        return found

    @classmethod
    def named_servers(cls, raw: Any) -> dict[str, str]:
        """{field: URL} of the servers a raw (unvalidated) grpo section would send the adapter and the
        prompts to: the recipe's trust rule (lorakit.recipe.read_back.check_servers) asks for them."""
        url = raw.get("vllm_server") if isinstance(raw, dict) else None
        return {"vllm_server": url} if isinstance(url, str) and url.strip() else {}

    def functions(self) -> list[str]:
        """The user reward functions named (`module:function`), in order."""
        return [r.name for r in self.rewards if r.is_function()]

    @model_validator(mode="after")
    def _check(self) -> GrpoSection:
        if self.vllm_server is not None and self.rollout_engine != "vllm":
            raise ValueError("grpo.vllm_server is for grpo.rollout_engine vllm")
        needs = [r.name for r in self.rewards if r.name in ANSWER_REWARDS]
        if needs and self.answer_column is None:
            raise ValueError(
                f"grpo.rewards {', '.join(needs)} compare with the row's answer: set grpo.answer_column"
            )
        return self


def check_grpo(recipe) -> None:
    """ValueError for what train.objective grpo cannot be combined with (`recipe`: the validated Recipe)."""
    from lorakit.objectives.dpo_settings import check_preference_rows

    if recipe.eval_active() and recipe.eval.generate:
        # Checked before the shared prompt-row checks, whose message describes the preference objectives' eval.
        raise ValueError(
            "eval.generate: a grpo evaluation already generates (one greedy completion per eval prompt, scored "
            "by grpo.rewards: reward, reward/NAME); set eval.generate: false"
        )
    check_preference_rows(recipe, "grpo", "its sampled completions", reference=recipe.grpo.beta > 0)
    if recipe.data.packing is True:
        raise ValueError(
            "data.packing: grpo generates from its prompt rows, which are not packed; set data.packing: auto "
            "(a causal LM's rollouts packed, per-example attention) or false (padded)"
        )


GRPO = ObjectiveSpec(
    name="grpo",
    check=check_grpo,
    no_tiled_loss="needs each completion token's log-probability from the logits",
    no_sequence_parallel="keeps each prompt's completions whole on one rank",
    loss_label="grpo",
)
