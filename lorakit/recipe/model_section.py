"""The recipe's model section: the pretrained base model and how it is loaded."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section


class ModelSection(Section):
    """The pretrained base model and how it is loaded."""

    name_or_path: str = Field(
        description="Hub model id, local directory, or `tiny:t5` (a tiny random T5 built locally by "
        "lorakit.testing, for smoke tests and the quickstart)."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the model.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="Weights and compute dtype; bf16 is the default on every modern GPU. On a CPU without bf16 "
        "instructions (AVX2), bf16 linear layers form their products in fp32 and round them once, as torch's "
        "own slow bf16 loop does (summary.json's matmul; LORAKIT_CPU_BF16_MATMUL=native keeps torch's).",
    )
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto",
        description="Attention backend. auto: flash_attention_2 when flash-attn is importable, a GPU is "
        "present and the model supports it; else sdpa; else eager.",
    )
    attention_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on attention probabilities in training. 0 (the default) lets packed rows on a "
        "CUDA GPU run the fused kernels (varlen_attn, compiled FlexAttention), which cannot apply it. It "
        "replaces T5's `dropout_rate` for attention weights only: FLAN-T5 (dropout_rate 0.1) still drops "
        "hidden states (embeddings, attention and feed-forward outputs) at 0.1. Above 0, packed T5 rows take "
        "per-example SDPA in training, as the console says. Causal LMs: replaces the config's "
        "`attention_dropout` (0 for Llama, Mistral, Qwen2).",
    )
    gradient_checkpointing: bool | Literal["auto", "selective"] = Field(
        "auto",
        description="Non-reentrant activation checkpointing of the transformer blocks: each checkpointed "
        "block keeps only its input and runs its forward again in the backward (about +50% step time for "
        "LoRA, +33% for full fine-tuning, when every block is checkpointed). true: every block (whole); "
        "false: none (off); selective: every k-th block (model.checkpoint_every, as torchtitan's and "
        "torchtune's selective layer checkpointing); auto: the memory planner picks, from the run's shapes "
        "and the GPU's memory, the first of off, selective (the largest k) and whole that fits with "
        "headroom; whole when there is no GPU memory to plan against (CPU runs). summary.json's "
        "`gradient_checkpointing` says what was chosen and why. See docs/planning.md.",
    )
    checkpoint_every: int | None = Field(
        None,
        ge=2,
        description="With model.gradient_checkpointing selective: checkpoint every k-th block (blocks 0, k, "
        "2k, ... of the model, counted over the encoder's and then the decoder's blocks of an "
        "encoder-decoder). null: the planner's largest k that fits with headroom on the run's GPUs; 2 "
        "without a GPU memory to plan against.",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile the parts of each transformer block (attention with its LoRA branches, MLP, "
        "norms), regionally: one graph per part kind, shapes dynamic so packed rows do not recompile. auto: on "
        "with a CUDA GPU for unquantized bases outside DeepSpeed ZeRO-3, off on CPUs (where compile time "
        "outweighs the gain). summary.json's `compile` reports the graphs and compile seconds.",
    )
    # issue 33: long rows (lorakit.model.tiled_mlp).
    tiled_mlp: bool | Literal["auto"] = Field(
        "auto",
        description="Compute each decoder layer's MLP over tiles of the sequence (ALST's tiled MLP): only one "
        "tile's intermediate activations (tile x intermediate_size, 14336 wide for Llama-3-8B) are alive at "
        "a time, for one more MLP forward per step. auto: on with distributed.sequence_parallel > 1 or "
        "train.max_tokens of 32768 or more; a forward of at most one tile runs the MLP as is. Causal LMs "
        "with dense MLPs (Llama, Mistral, Qwen2 and the like); tested with LoRA, QLoRA, full fine-tuning, "
        "gradient checkpointing, ZeRO-2 and ZeRO-3. See docs/long-context.md.",
    )
    mlp_tile_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per MLP tile when model.tiled_mlp tiles. null: the model's hidden_size (a "
        "tile's intermediate is then about one MLP weight matrix).",
    )
    tiled_loss: bool | Literal["auto"] = Field(
        "auto",
        description="Compute the output head and the cross-entropy over tiles of the sequence (ALST's tiled "
        "loss): the last hidden states go to the loss, and no logits of the whole row exist (at most one "
        "tile x vocabulary, in fp32), for one more head forward per step. auto: on with "
        "distributed.sequence_parallel > 1 or train.max_tokens of 32768 or more, for SFT on causal LMs "
        "whose logits are the head's output (Llama, Mistral, Mixtral, Qwen2/3, Phi-3, Gemma, OLMo 2). "
        "Not with objectives whose loss needs the logits (the preference ones). See docs/long-context.md.",
    )
    loss_tile_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per loss tile when model.tiled_loss tiles. null: about 2**25 logits per tile "
        "(261 tokens of a 128k vocabulary, 1024 of a 32k one).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the Python code a model repository ships (config.json `auto_map`) when loading its "
        "config, tokenizer and weights. Off: such a model is refused with a message naming this key. Turn it "
        "on only for a repository you trust: its code runs with your permissions.",
    )
    allow_pickle: bool = Field(
        False,
        description="Allow loading base weights from pickle files (pytorch_model.bin, *.pt), which can run "
        "code when read. Off: weights load only from safetensors, and a model that has none is refused with "
        "a message naming this key. What lorakit writes (adapter, full model, merged model) is safetensors.",
    )

    @model_validator(mode="after")
    def _check_tiles(self) -> ModelSection:
        if self.checkpoint_every is not None and self.gradient_checkpointing != "selective":
            raise ValueError(
                "model.checkpoint_every sets which blocks selective checkpointing checkpoints, and "
                "model.gradient_checkpointing is not selective: remove checkpoint_every or set "
                "gradient_checkpointing: selective"
            )
        if self.mlp_tile_tokens is not None and self.tiled_mlp is False:
            raise ValueError(
                "model.mlp_tile_tokens sizes the tiles of model.tiled_mlp, which is false: remove "
                "mlp_tile_tokens or set tiled_mlp: true (or auto)"
            )
        if self.loss_tile_tokens is not None and self.tiled_loss is False:
            raise ValueError(
                "model.loss_tile_tokens sizes the tiles of model.tiled_loss, which is false: remove "
                "loss_tile_tokens or set tiled_loss: true (or auto)"
            )
        return self
