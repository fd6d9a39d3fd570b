"""The device memory of a whole LongStraw update on one device, predicted from a config (`update_account`).

The weights by dtype or NF4 quantisation, LoRA adapters with their AdamW state, the prompt state by dtype (model
dtype or fp8 pages) and placement (on the device or in host memory, `prompt_state.prompt_state_bytes`), an estimate
of the largest working set (one replay's autograd graph, or one capture chunk), and the rollout before the update (one
prompt state per prompt of the generation batch, with its rows' decoded tokens). The first three are byte counts
checked against real allocations; the working set is an estimate and is labelled so wherever it is printed.

Everything here is computed from a config's meta-device skeleton (no weights are loaded). Weights, LoRA and state are
exact byte counts of what bitsandbytes, PEFT and the capture allocate (tests/test_accounting.py checks each against
the real allocation on a tiny model). The replay's graph and the capture chunk's working set are ESTIMATES:
upper-leaning models of what autograd saves and of the largest transient tensors, calibrated against the saved
tensors of a real replay on the tiny models of every family (test_replay_estimate_bounds_the_saved_activations).
What is not modelled at all: the CUDA context and the caching allocator's fragmentation, NCCL buffers, the generation
(vLLM or transformers) and anything the user's own code keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn
from transformers import PretrainedConfig

from ..architectures import check_supported, config_key, model_skeleton
from ..state.registry import decoder_layers
from .prompt_state import prompt_state_bytes, skeleton_of, under_context_parallelism

NF4_BLOCKSIZE = 64  # bitsandbytes' default 4-bit blocksize (BitsAndBytesConfig has no blocksize field)
NF4_CODE_VALUES = 16  # the NF4 code book, fp32, one copy per quantised weight (bitsandbytes builds it per weight)
NESTED_BLOCKSIZE = 256  # double quantisation: absmax values quantised to uint8 in blocks of 256
NESTED_CODE_VALUES = 256  # double quantisation's 8-bit dynamic code book, fp32, one copy per quantised weight
FP32_BYTES = 4
INDEX_BYTES = 8  # int64 token indices
BF16_BYTES = 2

# Replay-graph estimate, per token and decoder layer, in activation-dtype elements: ACTIVATION_FACTOR x (the inputs
# and outputs of every linear map a token passes through + two norm inputs). The factor covers what the matmuls do
# not (activation functions and their products, RoPE, gates, casts, LoRA's rank-r intermediates). Measured on the
# tiny model of every family (fp32, no checkpointing), the whole `saved` term is 1.1x to 2.1x what autograd saved.
ACTIVATION_FACTOR = 2.0
# (What the recurrent kernels hold for backward is their kinds' `replay_saved_bytes`.)
# TRL's fused LM head (trl.kernels.chunked_logprob): tiles of [min(tokens, 4096), 32768] logits in the compute dtype,
# and an fp32 gradient of the hidden states in backward.
# The prefix attention's working set where a fused kernel takes a chunk (CUDA's memory-efficient kernel): no score
# tile, but partial outputs [heads, tokens, head_dim] in fp32: the chunk's, the running one and their merge.
FUSED_PARTIALS = 3
LM_HEAD_TOKEN_TILE = 4096
LM_HEAD_VOCAB_TILE = 32768


def nf4_weight_bytes(numel: int, double_quant: bool, blocksize: int = NF4_BLOCKSIZE) -> int:
    """Bytes bitsandbytes keeps for one NF4-quantised weight of `numel` values (`Params4bit` + its `QuantState`).

    packed values: ceil(numel / 2) uint8 (two 4-bit codes per byte);
    absmax: one per block of `blocksize`: fp32 without double quantisation; with it, uint8 plus one fp32 per
    `NESTED_BLOCKSIZE` blocks, one fp32 offset and the nested 256-entry fp32 code book;
    the NF4 code book: 16 fp32 (bitsandbytes 0.50 keeps both code books per weight: measured, see the tests).
    At blocksize 64: 0.5 + 4/64 = 0.5625 byte/value without double quantisation, 0.5 + 1/64 + 4/16384 ~ 0.5158 with
    (plus 64 B, or 1,092 B with double quantisation, per weight).
    """
    blocks = -(-numel // blocksize)
    if double_quant:
        absmax = blocks + FP32_BYTES * (-(-blocks // NESTED_BLOCKSIZE) + 1 + NESTED_CODE_VALUES)
    else:
        absmax = FP32_BYTES * blocks
    return -(-numel // 2) + absmax + FP32_BYTES * NF4_CODE_VALUES


@dataclass(frozen=True)
class WeightAccount:
    """The model's weights on the device: NF4-quantised linear weights and everything kept at full width."""

    quantized_params: int = 0
    quantized_bytes: int = 0  # packed codes and quantisation states
    dense_params: int = 0
    dense_bytes: int = 0
    buffer_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.quantized_bytes + self.dense_bytes + self.buffer_bytes

    @property
    def quantization_state_bytes(self) -> int:
        """The NF4 weights' bytes besides their packed codes (absmax, code books): a module attribute FSDP2 does not
        shard, whole on every rank."""
        return self.quantized_bytes - -(-self.quantized_params // 2) if self.quantized_params else 0

    @property
    def params(self) -> int:
        return self.quantized_params + self.dense_params

    def shardable_bytes(self) -> int:
        """What FSDP2 splits over its shards: every byte but the NF4 quantisation states."""
        return self.bytes - self.quantization_state_bytes


def weight_account(
    config: PretrainedConfig | nn.Module,
    quantization: Literal["none", "nf4"] = "none",
    double_quant: bool = True,
    dtype_bytes: int = 2,
    trust_remote_code: bool = False,
) -> WeightAccount:
    """Bytes of `config`'s weights as `from_pretrained(dtype=bf16, quantization_config=...)` leaves them.

    `quantization="nf4"`: the linear maps transformers' bitsandbytes integration converts (every `nn.Linear` except
    the output embedding, tied weights and the model's `_keep_in_fp32_modules`, found with transformers' own
    `get_keys_to_not_convert` / `should_convert_module`) cost `nf4_weight_bytes`; everything else (embeddings, norms,
    the LM head, convolutions, routers, fused MoE expert tensors, biases) stays at `dtype_bytes`, except parameters
    named by the model's `_keep_in_fp32_modules_strict` (fp32 under bf16, e.g. GLM-5's router). Buffers (RoPE
    frequencies) are counted at their own dtype.
    """
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skeleton = skeleton_of(config, trust_remote_code)
    strict_fp32 = list(getattr(skeleton, "_keep_in_fp32_modules_strict", None) or [])
    quantized: set[str] = set()
    if quantization == "nf4":
        skip = get_keys_to_not_convert(skeleton) + list(getattr(skeleton, "_keep_in_fp32_modules", None) or [])
        quantized = {
            name
            for name, module in skeleton.named_modules()
            if type(module) is nn.Linear and should_convert_module(name, skip)
        }
    elif quantization != "none":
        raise ValueError(f"quantization={quantization!r}: 'none' or 'nf4'")
    account = {"quantized_params": 0, "quantized_bytes": 0, "dense_params": 0, "dense_bytes": 0}
    for name, param in skeleton.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if module_name in quantized and leaf == "weight":
            account["quantized_params"] += param.numel()
            account["quantized_bytes"] += nf4_weight_bytes(param.numel(), double_quant)
            continue
        width = FP32_BYTES if any(pattern in name for pattern in strict_fp32) else dtype_bytes
        account["dense_params"] += param.numel()
        account["dense_bytes"] += param.numel() * width
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in skeleton.buffers())
    return WeightAccount(**account, buffer_bytes=buffers)


@dataclass(frozen=True)
class LoraAccount:
    """LoRA adapters and what AdamW keeps for them: per trainable value, its weight, its gradient, `exp_avg` and
    `exp_avg_sq`, each at `value_bytes` (fp32 by PEFT's default; TRL 1.16 casts QLoRA adapters to bf16, so 2)."""

    rank: int
    params: int
    value_bytes: int = FP32_BYTES
    largest_fused_target: int = 0  # elements of the largest fused expert tensor the adapter targets (0: none)

    @property
    def bytes(self) -> int:
        return 4 * self.params * self.value_bytes

    def merge_check_bytes(self, dtype_bytes: int) -> int:
        """What each forward through LoRA-adapted fused experts allocates for a moment beyond its activations: PEFT
        registers its parametrization per forward, and torch's registration check evaluates it once, the merged
        stack of the largest adapted tensor, freed at once. LongStraw's experts apply the LoRA to the routed tokens
        and keep no merged stack after it (experts.py)."""
        return self.largest_fused_target * dtype_bytes


def lora_account(
    config: PretrainedConfig,
    rank: int,
    target_modules: str | Sequence[str] | None = "all-linear",
    value_bytes: int = FP32_BYTES,
    trust_remote_code: bool = False,
) -> LoraAccount:
    """LoRA of `rank` on `target_modules`, counted by PEFT itself on the meta-device skeleton (no memory).

    Per adapted linear map PEFT adds `rank x (in_features + out_features)` values (A and B). Which maps it adapts is
    PEFT's rule, not a formula, so PEFT is asked: `"all-linear"` is every linear map but the output embedding, and on
    transformers 5 MoE models whose experts are fused `[experts, out, in]` tensors, PEFT (0.21) turns the names
    `gate_proj` / `up_proj` / `down_proj` into LoRA on the fused expert tensors (`rank x experts x (in + out)` each,
    at twice the rank on `gate_up_proj` when both halves are named) and no longer adapts the dense or shared-expert
    maps of those names.
    """
    targets = target_modules if target_modules is None or isinstance(target_modules, str) else tuple(target_modules)
    key = (config_key(config, trust_remote_code), rank, targets)
    if key not in _LORA_COUNTS:  # a plan asks once per setting it tries; PEFT wraps a whole skeleton each time
        _LORA_COUNTS[key] = _lora_counts(config, rank, targets, trust_remote_code)
    trainable, largest_fused_target = _LORA_COUNTS[key]
    return LoraAccount(rank, trainable, value_bytes, largest_fused_target=largest_fused_target)


_LORA_COUNTS: dict[tuple, tuple[int, int]] = {}


def _lora_counts(config, rank: int, targets, trust_remote_code: bool) -> tuple[int, int]:
    """PEFT's trainable values for LoRA of `rank` on `targets`, and its largest adapted fused expert tensor."""
    import peft
    import torch
    from peft.tuners.lora.layer import ParamWrapper

    skeleton = model_skeleton(config, trust_remote_code=trust_remote_code)
    targets = list(targets) if isinstance(targets, tuple) else targets
    with torch.device("meta"):
        adapted = peft.get_peft_model(skeleton, peft.LoraConfig(r=rank, target_modules=targets))
    trainable, _ = adapted.get_nb_trainable_parameters()
    fused = [wrapper.get_param().numel() for wrapper in adapted.modules() if isinstance(wrapper, ParamWrapper)]
    return trainable, max(fused, default=0)


def _layer_linear_elements(layer: nn.Module, experts_per_token: int) -> int:
    """Inputs + outputs of every linear map one token passes through in `layer` (per token, in elements). Fused MoE
    expert tensors `[experts, out, in]` count for the `experts_per_token` experts a token is routed to."""
    total = 0
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            total += module.in_features + module.out_features
            continue
        for param in module.parameters(recurse=False):
            if param.dim() == 3:  # fused experts: [experts, out, in] (or [experts, in, out])
                total += experts_per_token * (param.shape[1] + param.shape[2])
    return total


@dataclass(frozen=True)
class GraphAccount:
    """An ESTIMATE of the largest working set of one forward (+ backward) of `tokens` tokens over the prompt state:
    what autograd saves (`saved`), the backward's working set (`backward`), the prefix attention's fp32 score tiles
    (`attention_tiles`), TRL's fused LM head (`lm_head`), transformers' DSA indexer (`indexer`), under context
    parallelism the step attention's gathered inputs and exchanged partials (`step_attention`), and for a member
    replayed in segments its earlier segments' state and that state's gradient (`member_state`)."""

    tokens: int
    saved: int = 0
    backward: int = 0
    attention_tiles: int = 0
    lm_head: int = 0
    indexer: int = 0
    step_attention: int = 0
    member_state: int = 0

    @property
    def bytes(self) -> int:
        return (
            self.saved
            + self.backward
            + self.attention_tiles
            + self.lm_head
            + self.indexer
            + self.step_attention
            + self.member_state
        )


def replay_graph_account(
    config: PretrainedConfig | nn.Module,
    completion_tokens: int,
    prompt_tokens: int,
    attention_chunk_size: int,
    activation_checkpointing: bool,
    dtype_bytes: int = 2,
    trust_remote_code: bool = False,
    fused_kernels: bool = True,
) -> GraphAccount:
    """ESTIMATE of one member's replay under autograd: `[last prompt token, completion]` = R + 1 tokens.

    saved: ACTIVATION_FACTOR x (linear inputs + outputs + 2 x hidden) per token and layer at `dtype_bytes`, plus what
    the recurrent kernels hold for backward (`fused_kernels`: the GPU's, fla's; else transformers' torch fallbacks, as
    a CPU run saves: `LayerState.replay_saved_bytes`); with activation checkpointing, one hidden state per token and layer plus one
    layer's activations recomputed in backward. backward: one layer's activations again (gradients of the layer being
    back-propagated, in flight). attention_tiles: the prefix attention visits the prompt in chunks of
    `attention_chunk_size` keys, each a `[heads, R + 1, chunk]` fp32 score tile and its exponent (two alive at once
    on the plain-torch path; a fused kernel keeps less). lm_head: TRL's fused head, `[min(R, 4096), 32768]` logits
    tiles in the compute dtype plus the fp32 gradient of `[R, hidden]`. indexer: the DSA indexer's scores of the
    replayed tokens against their own keys and, alive beside them, against one block of `attention_chunk_size`
    prompt keys (state/dsa.py): `[R + 1, index_heads, keys]` fp32 scores and their ReLU, plus `[R + 1, keys]` index
    scores (fp32) and mask (bool), for both.
    """
    return _graph_account(
        config,
        completion_tokens + 1,
        prompt_tokens,
        attention_chunk_size,
        activation_checkpointing,
        True,
        dtype_bytes,
        trust_remote_code,
        fused_kernels,
    )


def segmented_replay_account(config: PretrainedConfig | nn.Module, setup: UpdateSetup) -> GraphAccount:
    """ESTIMATE of one member's replay as the engine runs it: whole (`replay_graph_account`), or, for a member longer
    than `setup.replay_segment_size` (`LongStrawEngine.member_segments`), the graph of its longest segment (one token
    longer than a segment at most) beside the state of every segment before the last, kept as exact mode keeps a
    prompt's (every entry, a recurrent state per segment boundary), and that state's gradient (all of it but the DSA
    indexer keys, which take none)."""
    replayed, size = setup.completion_tokens + 1, setup.replay_segment_size
    segmented = size is not None and replayed > size
    graph = replay_graph_account(
        config,
        min(setup.completion_tokens, size) if segmented else setup.completion_tokens,
        setup.prompt_tokens - 1 + (replayed if segmented else 0),
        setup.attention_chunk_size,
        setup.activation_checkpointing,
        setup.dtype_bytes,
    )
    if not segmented:
        return graph
    last = replayed - (replayed - 1) // size * size
    held = replayed - (last if last >= 2 else last + size)
    state = prompt_state_bytes(config, held, setup.dtype_bytes, exact=True, prefill_chunk_size=size)
    gradient = sum(bytes_ for label, bytes_ in state.items() if label != "dsa_indexer_keys")
    return replace(graph, member_state=sum(state.values()) + gradient)


def replay_in_steps_account(
    config: PretrainedConfig | nn.Module, setup: UpdateSetup, chunk_tokens: int, held_tokens: int
) -> GraphAccount:
    """ESTIMATE of one rank's share of a member's replay under context parallelism when the CP group replays it in
    steps (`ContextParallel.in_steps`: longer than `setup.replay_segment_size`): the graph of one chunk of the
    member of `chunk_tokens` tokens without activation checkpointing (the chunks are recomputed as the prompt's are),
    beside this rank's `held_tokens` of the member's state, kept as exact mode keeps a prompt's, and their gradient
    (all of it but the DSA indexer keys). The step attention's share is the caller's (`plan_run`)."""
    replayed = setup.completion_tokens + 1
    graph = replay_graph_account(
        config,
        chunk_tokens - 1,
        setup.prompt_tokens - 1 + replayed,
        setup.attention_chunk_size,
        False,
        setup.dtype_bytes,
    )
    state = prompt_state_bytes(config, held_tokens, setup.dtype_bytes, exact=True, prefill_chunk_size=chunk_tokens)
    gradient = sum(bytes_ for label, bytes_ in state.items() if label != "dsa_indexer_keys")
    return replace(graph, member_state=sum(state.values()) + gradient)


def capture_chunk_account(
    config: PretrainedConfig | nn.Module,
    prefill_chunk_size: int,
    prompt_tokens: int,
    attention_chunk_size: int,
    dtype_bytes: int = 2,
    trust_remote_code: bool = False,
) -> GraphAccount:
    """ESTIMATE of one no-grad capture chunk's transient tensors: about 3 x (the widest linear output) + 3 x hidden
    per token (a gated MLP's gate, up and product beside the residual stream), the attention tiles of its
    `prefill_chunk_size` queries over one key chunk, and the DSA indexer's scores against the chunk's own keys and one
    block of prompt keys."""
    return _graph_account(
        config,
        min(prefill_chunk_size, prompt_tokens),
        prompt_tokens,
        attention_chunk_size,
        False,
        False,
        dtype_bytes,
        trust_remote_code,
    )


def step_attention_bytes(
    config: PretrainedConfig | nn.Module,
    tokens: int,
    context_parallel: int,
    grad: bool,
    dtype_bytes: int = 2,
    trust_remote_code: bool = False,
) -> int:
    """ESTIMATE of the context-parallel step attention's working set at its widest layer (`context_parallel/step.py`),
    for `tokens` tokens per rank; 0 without context parallelism. A capture's step gathers every rank's keys and values
    (model dtype) and goes through the rows in `context_parallel` pieces: each gathers every rank's queries of the
    piece (one chunk's worth in all) and holds every rank's fp32 partials `heads x (dv + 1)` of them, sent and
    received, beside this rank's merged output. A replay's rows gather no keys; their backward holds, per piece, the
    gathered output gradients, outputs and log-sum-exps (about two partials' worth) and the fp32 query gradients sent
    and received, beside the whole query gradient. A DSA layer adds every rank's top-k, gathered, and this rank's picks
    of its pages for each (int64 both), for the layer's forward (and its recompute under checkpointing)."""
    if context_parallel == 1:
        return 0
    skeleton = skeleton_of(config, trust_remote_code)
    text_config = skeleton.config.get_text_config()
    widest = 0
    for plan in check_supported(skeleton):
        per_token = 0
        for kind, mixer in plan.kinds:
            query, key_value, partial = kind.step_attention_elements(mixer, text_config)
            if grad:
                per_token += query * dtype_bytes + (3 * query + 2 * partial) * FP32_BYTES
            else:
                per_token += (
                    context_parallel * key_value * dtype_bytes + query * dtype_bytes + 3 * partial * FP32_BYTES
                )
            per_token += 2 * context_parallel * kind.step_selection_elements(mixer) * INDEX_BYTES
        widest = max(widest, per_token)
    return tokens * widest


def _graph_account(
    config, tokens, prompt_tokens, attention_chunk_size, checkpointing, grad, dtype_bytes, trust_remote_code,
    fused_kernels=True,
) -> GraphAccount:  # fmt: skip
    skeleton = skeleton_of(config, trust_remote_code)
    plans = check_supported(skeleton)
    text_config = skeleton.config.get_text_config()
    hidden = text_config.hidden_size
    top_k = getattr(text_config, "num_experts_per_tok", None) or 1
    layers = decoder_layers(skeleton)
    per_layer = []
    for plan, layer in zip(plans, layers, strict=True):
        elements = ACTIVATION_FACTOR * (_layer_linear_elements(layer, top_k) + 2 * hidden) * dtype_bytes
        recurrent = sum(kind.replay_saved_bytes(mixer, dtype_bytes, fused_kernels) for kind, mixer in plan.kinds)
        per_layer.append(int(elements) + recurrent)
    kinds = [(kind, mixer, plan.layer_type) for plan in plans for kind, mixer in plan.kinds]
    tiled = [kind.prompt_score_tiles(mixer, text_config, layer_type) for kind, mixer, layer_type in kinds]
    heads = [kind.attention_heads(mixer, text_config) for kind, mixer, _ in kinds]
    index_heads = max((kind.index_heads(mixer) for kind, mixer, _ in kinds), default=0)
    keys = prompt_tokens + (tokens if grad else 0)
    tile_heads = max((count for count, tiles in zip(heads, tiled, strict=True) if tiles), default=0)
    fused_heads = max((count for count, tiles in zip(heads, tiled, strict=True) if not tiles), default=0)
    head_width = getattr(text_config, "head_dim", None) or hidden // max(text_config.num_attention_heads, 1)
    # a score tile and its exponent; a fused kernel's chunk output, the running output and their merge, in fp32
    tiles = 2 * tile_heads * tokens * min(attention_chunk_size, max(keys, 1)) * FP32_BYTES
    tiles = max(tiles, FUSED_PARTIALS * fused_heads * tokens * head_width * FP32_BYTES)
    indexer_keys = tokens + min(attention_chunk_size, max(prompt_tokens, 1))  # own keys + one block of the prompt's
    indexer = index_heads and tokens * indexer_keys * (2 * index_heads * FP32_BYTES + FP32_BYTES + 1)
    if not grad:  # no autograd: the widest transient of one layer, not what a backward would need
        widest = max(
            (m.out_features for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)), default=hidden
        )
        transient = tokens * (3 * widest + 3 * hidden) * dtype_bytes
        return GraphAccount(tokens, saved=transient, attention_tiles=tiles, indexer=indexer)
    one_layer = tokens * max(per_layer)
    if checkpointing:
        saved = tokens * len(per_layer) * hidden * dtype_bytes + one_layer
    else:
        saved = tokens * sum(per_layer)
    head_tokens = min(tokens, LM_HEAD_TOKEN_TILE)
    vocab_tile = min(LM_HEAD_VOCAB_TILE, text_config.vocab_size)
    lm_head = head_tokens * vocab_tile * dtype_bytes + tokens * hidden * FP32_BYTES
    return GraphAccount(tokens, saved, one_layer, tiles, lm_head, indexer)


@dataclass(frozen=True)
class UpdateSetup:
    """One LongStraw update on one device: the knobs that decide its memory (defaults: the recipes' choices)."""

    prompt_tokens: int
    completion_tokens: int
    group_size: int = 8
    quantization: Literal["none", "nf4"] = "none"
    double_quant: bool = True
    lora_rank: int | None = 16  # None: full fine-tuning is not modelled; no adapters counted
    lora_targets: str | tuple[str, ...] | None = "all-linear"  # None: PEFT's default for the model type
    lora_value_bytes: int | None = None  # None: as TRL keeps them, bf16 on a quantised model (TRL 1.16), else fp32
    state_dtype: Literal["auto", "float8_e4m3fn"] = "auto"
    state_device: Literal["device", "cpu"] = "device"
    activation_checkpointing: bool = True
    prefill_chunk_size: int = 2048
    attention_chunk_size: int = 4096
    dtype_bytes: int = 2
    prompts_per_generation: int = 1  # distinct prompts of a process's generation batch (0: generation not modelled)
    prompt_gradient: Literal["detach", "exact"] = "detach"  # the plan models detach mode; a simulation runs either
    beta: float = 0.0  # != 0: the reference model's capture and scores (GRPOConfig.beta)
    num_iterations: int = 1  # > 1: the old policy's scores (GRPOConfig.num_iterations)
    replay_segment_size: int | None = None  # a longer member is replayed in segments (LongStrawGRPOConfig's field)

    @property
    def adapter_value_bytes(self) -> int:
        if self.lora_value_bytes is not None:
            return self.lora_value_bytes
        return BF16_BYTES if self.quantization == "nf4" else FP32_BYTES


@dataclass(frozen=True)
class UpdateAccount:
    """Predicted memory of one detach-mode update and the rollout before it. `device_bytes`: what the device holds at
    the larger of two peaks, both beside the weights and the adapters with their optimizer state: the update's (the
    prompt state if it lives there, the larger of the replay's and the capture chunk's working sets, and the group's
    per-token scalars) and the rollout's (`rollout_bytes`); `host_bytes`: a host-resident state."""

    setup: UpdateSetup
    weights: WeightAccount
    lora: LoraAccount | None
    state: dict[str, int]
    replay: GraphAccount
    capture: GraphAccount
    group_scalars: int
    decoded_row: int  # one rollout row's decoded tokens (`Suffix`): R tokens' entries and its recurrent states
    # how context parallelism holds each `state` label, as its kinds answer: "split", "replicated" or "refused"
    state_under_context_parallelism: dict[str, str] = field(default_factory=dict)

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())

    @property
    def working_set(self) -> GraphAccount:
        return max(self.replay, self.capture, key=lambda graph: graph.bytes)

    @property
    def merge_check(self) -> int:
        """The merged expert stack PEFT's parametrization check allocates for a moment per forward (`LoraAccount`)."""
        return self.lora.merge_check_bytes(self.setup.dtype_bytes) if self.lora else 0

    def rollout_bytes(self, state_bytes: int) -> int:
        """The rollout's peak beyond weights and adapters: one prompt state (`state_bytes` of it on the device) per
        distinct prompt of the generation batch, alive together while the rows decode in lockstep, and each prompt's
        G rows' decoded tokens."""
        setup = self.setup
        return setup.prompts_per_generation * (state_bytes + setup.group_size * self.decoded_row)

    def device_total(self, state_bytes: int) -> int:
        """The device's peak with `state_bytes` of one prompt state on it: the update's or the rollout's."""
        lora = self.lora.bytes if self.lora else 0
        update = state_bytes + self.working_set.bytes + self.merge_check + self.group_scalars
        return self.weights.bytes + lora + max(update, self.rollout_bytes(state_bytes))

    @property
    def device_bytes(self) -> int:
        return self.device_total(self.state_bytes if self.setup.state_device == "device" else 0)

    @property
    def host_bytes(self) -> int:
        return self.state_bytes if self.setup.state_device == "cpu" else 0


def update_account(config: PretrainedConfig, setup: UpdateSetup, trust_remote_code: bool = False) -> UpdateAccount:
    """Predict the memory of one detach-mode LongStraw update of `config` under `setup` (see `UpdateAccount`).

    In the update the group size enters only through per-token scalars (log-probs, old log-probs, advantages, masks:
    eight `[G, R]` fp32 tensors): the state is captured once and members are replayed one at a time. The rollout
    before it holds G rows' decoded tokens per prompt, beside one prompt state per prompt of the generation batch.
    """
    remote = {"trust_remote_code": trust_remote_code}
    lora = None
    if setup.lora_rank:  # PEFT wraps the modules of its own skeleton
        lora = lora_account(config, setup.lora_rank, setup.lora_targets, setup.adapter_value_bytes, **remote)
    skeleton = skeleton_of(config, **remote)  # one skeleton for everything else
    weights = weight_account(skeleton, setup.quantization, setup.double_quant, setup.dtype_bytes)
    state = prompt_state_bytes(skeleton, setup.prompt_tokens - 1, setup.dtype_bytes, setup.state_dtype)
    replay = segmented_replay_account(skeleton, setup)
    capture = capture_chunk_account(
        skeleton, setup.prefill_chunk_size, setup.prompt_tokens - 1, setup.attention_chunk_size, setup.dtype_bytes
    )
    scalars = 8 * setup.group_size * setup.completion_tokens * FP32_BYTES
    decoded_row = sum(prompt_state_bytes(skeleton, setup.completion_tokens, setup.dtype_bytes).values())
    held = under_context_parallelism(skeleton)
    return UpdateAccount(setup, weights, lora, state, replay, capture, scalars, decoded_row, held)
