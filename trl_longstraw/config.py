"""`LongStrawGRPOConfig`: `GRPOConfig` plus the fields of the capture-once, replay-the-suffix update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

PROMPT_GRADIENT_MODES = ("detach", "exact")


@dataclass
class LongStrawGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`LongStrawGRPOTrainer`]. Every [`~trl.GRPOConfig`] field keeps its meaning; a setting the
    LongStraw update cannot honour is rejected here with a `ValueError` that names it.

    LongStraw parameters:
        prompt_gradient (`str`, defaults to `"detach"`): `"detach"` treats the captured prompt state as a constant
            (the paper's capacity mode); `"exact"` also pushes the gradient of the prompt state into the parameters,
            giving the same gradient as stock `GRPOTrainer`, at the cost of one prompt forward+backward per group.
        prefill_chunk_size (`int`, defaults to `2048`): prompt tokens per no-grad capture forward.
        attention_chunk_size (`int`, defaults to `4096`): prompt keys per step of the prefix attention.
        prompt_state_device (`str`, defaults to `"auto"`): where the prompt state lives: `"auto"` (the model's
            device), `"cpu"`, or any torch device string.
        log_phase_metrics (`bool`, defaults to `True`): log wall time and peak memory per phase under `longstraw/`.

    `disable_dropout` defaults to `True` here (the replay must reproduce the scoring pass token for token) and
    `activation_checkpointing` (alias `gradient_checkpointing`) to `False` (only the short completions run under
    autograd).
    """

    prompt_gradient: str = field(
        default="detach",
        metadata={
            "help": "Gradient through the captured prompt state. 'detach' (default, the paper's capacity mode): the "
            "state is a constant and gradients flow only through the replayed tokens. 'exact': the same gradient as "
            "stock GRPOTrainer, by accumulating the state's gradient over the group's members and back-propagating "
            "it through one chunked recompute of the prompt per group.",
            "choices": list(PROMPT_GRADIENT_MODES),
        },
    )
    prefill_chunk_size: int = field(
        default=2048,
        metadata={
            "help": "Prompt tokens per no-grad capture forward. Bounds the activations of the capture (and of the "
            "exact-mode prompt recompute) to one chunk."
        },
    )
    attention_chunk_size: int = field(
        default=4096,
        metadata={
            "help": "Prompt keys per step of the prefix attention (forward and recomputing backward). Bounds its "
            "score matrix to [query rows, attention_chunk_size] per kv head."
        },
    )
    prompt_state_device: str = field(
        default="auto",
        metadata={
            "help": "Where the captured prompt state lives: 'auto' (the model's device), 'cpu' (host memory, staged "
            "chunk by chunk onto the compute device when read), or a torch device string such as 'cuda:1'."
        },
    )
    log_phase_metrics: bool = field(
        default=True,
        metadata={
            "help": "Log wall time and peak memory of each phase (capture, capture_ref, score, replay, "
            "prompt_backward, optimizer) and the prompt-state size under 'longstraw/' in the trainer logs."
        },
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Activation checkpointing of the replayed completion (TRL turns it on by default). Off by default "
            "here: the prompt never goes through autograd, and for short completions recomputing the replay's layers "
            "recompute each layer for no memory gain (measured at R = 128: same peak). Turn it on for long "
            "completions. "
            "Unset (and `gradient_checkpointing` unset) means False."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers), which takes precedence."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Whether to disable dropout in the model. LongStraw needs it off (the default here): the replay "
            "of a member must reproduce the log-probs its loss gradient was computed from."
        },
    )

    def __post_init__(self):
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = False
        self._validate_longstraw_fields()
        self._validate_grouping()
        super().__post_init__()

    def _validate_longstraw_fields(self) -> None:
        if self.prompt_gradient not in PROMPT_GRADIENT_MODES:
            raise ValueError(
                f"prompt_gradient={self.prompt_gradient!r} is not supported: use one of {PROMPT_GRADIENT_MODES}."
            )
        for name in ("prefill_chunk_size", "attention_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer (e.g. 2048).")
        if self.prompt_state_device != "auto":
            try:
                torch.device(self.prompt_state_device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(
                    f"prompt_state_device={self.prompt_state_device!r} is not a device: use 'auto', 'cpu' or a torch "
                    "device string such as 'cuda:0'."
                ) from error
        if self.deepspeed or self.fsdp:
            raise ValueError(
                "LongStrawGRPOTrainer supports data parallelism through DDP (plain `accelerate launch`), not "
                "DeepSpeed or FSDP (`deepspeed`/`fsdp` are set): the serial replay runs on the unsharded model. Unset "
                "them; to fit a large model use QLoRA (`load_in_4bit`) and `prompt_state_device='cpu'`."
            )

    def _validate_grouping(self) -> None:
        if self.per_device_train_batch_size % self.num_generations != 0:
            raise ValueError(
                f"per_device_train_batch_size={self.per_device_train_batch_size} is not a multiple of "
                f"num_generations={self.num_generations}: a micro-step would split a group, and LongStraw captures "
                f"each group's prompt once for all its members. Set per_device_train_batch_size to "
                f"{self.num_generations} (or a multiple) and use gradient_accumulation_steps for larger batches."
            )
        if self.do_eval and self.eval_strategy != "no":
            num_generations_eval = self.num_generations_eval or self.num_generations
            if self.per_device_eval_batch_size % num_generations_eval != 0:
                raise ValueError(
                    f"per_device_eval_batch_size={self.per_device_eval_batch_size} is not a multiple of the "
                    f"evaluation group size {num_generations_eval} (num_generations_eval or num_generations): an "
                    "evaluation batch would split a group. Make it a multiple."
                )
