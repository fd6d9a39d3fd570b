"""DSA (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5) indexer keys of the layers that compute their own top-k.

An index-computing layer keeps its indexer keys (`index_head_dim` per token). No gradient flows through them:
transformers' indexer runs under `no_grad`, and the selection it makes is discrete. IndexShare layers (GLM-5's
`indexer_types == "shared"`) have no indexer module and reuse the previous computing layer's selection, which the
model passes between layers itself, so they keep nothing here.

The selection is the model's own indexer, never a re-implementation of its scoring, but it never scores a token
against the whole prompt at once (transformers' indexer would hold `[tokens, index_heads, P]` fp32 scores: 4 TiB for
a GLM-5 capture chunk at 2M positions). A forward's indexer call sees only the forward's own keys (the Cache API's
`update_indexer` hands back no prompt key, and the masks span the own keys only); its `topk` of those scores is
intercepted ([`IndexerSelection`], a `TorchFunctionMode` entered by the indexer's forward hooks) and becomes the top-k
over the prompt's keys too: the indexer's `forward` runs again over the prompt's keys block by block (staged from
host memory where the state lives there), each block's top-k candidates merged with the running best. The top-k of
the whole prefix is always among the blocks' top-k candidates, so this is exact; exactly tied index scores may be
broken differently than one `topk` over everything (as between two chunkings). The transient is at most the scores
of `[tokens, index_heads, attention_chunk_size]`, taken as fewer query rows against wider key blocks (up to
`INDEXER_KEYS_PER_CALL`, or `attention_chunk_size` if larger), because each call reruns the indexer's query side.
Under context parallelism each rank does this over its shard and the candidates are merged across ranks
(`context_parallel/state.py`).
"""

from __future__ import annotations

import inspect

import torch
from torch.overrides import TorchFunctionMode

from ..block_attention import visits
from .mla import is_multi_head_latent_attention
from .placement import Pages
from .prompt_state import StateAccess
from .registry import LayerAccount, LayerState

_TOPK = (torch.Tensor.topk, torch.topk)

# The most prompt keys one indexer call over the prompt scores (or `attention_chunk_size`, if larger). Every call runs
# the indexer's query side again (its projections of the call's tokens: `wq_b`, `weights_proj`, `wk`, RoPE), so a
# call covers as many keys as the score transient allows (`IndexerKeys.prompt_candidates`). GLM-5 (32 index heads
# of 128, q_lora_rank 2,048, hidden 6,144): about 9.4M multiply-adds of query side per token and call against 4.1K
# of scoring per key, i.e. 28% on top of the scoring with calls of 8,192 keys, 3.5% with 65,536, whose fp32 key
# copy is 32 MiB.
INDEXER_KEYS_PER_CALL = 65_536


def merge_candidates(
    best: tuple[torch.Tensor, torch.Tensor] | None, new: tuple[torch.Tensor, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`k` of two sets of `(scores, global key indices)` candidates `[batch, tokens, n]`."""
    if best is None:
        return new
    values, ids = torch.cat([best[0], new[0]], dim=-1), torch.cat([best[1], new[1]], dim=-1)
    values, which = values.topk(min(k, values.shape[-1]), dim=-1)
    return values, ids.gather(-1, which)


class _BlockKeys:
    """The Cache an indexer call over one block of the prompt's keys gets: that block, whatever the call's own."""

    def __init__(self, keys: torch.Tensor):
        self.keys = keys

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.keys


class _BlockCandidates(TorchFunctionMode):
    """Active during one indexer call over a block of keys: keeps its top-k (scores and global key indices)."""

    def __init__(self, k: int, key_index: torch.Tensor):
        super().__init__()
        self.k, self.key_index = k, key_index
        self.candidates: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _TOPK:
            return func(*args, **(kwargs or {}))
        scores = args[0]
        values, picked = scores.topk(min(self.k, scores.shape[-1]), dim=-1)
        self.candidates = (values, self.key_index[picked])
        return torch.return_types.topk((values, picked))


def indexer_call(indexer, args, kwargs) -> dict:
    """The arguments of one call of a DSA indexer's `forward`, by name (`hidden_states`, `q_resid`,
    `position_embeddings`, `attention_mask`, `cache`, ...)."""
    return inspect.signature(indexer.forward).bind(*args, **kwargs).arguments


def block_candidates(indexer, call: dict, keys: torch.Tensor, key_index: torch.Tensor, k: int):
    """The top-`k` candidates among `keys [1, n, index_head_dim]` (global indices `key_index`, every key visible to
    every query) for the queries of one indexer `call`: the indexer's own `forward` over them."""
    hidden = call["hidden_states"]
    visible = torch.ones((*hidden.shape[:2], keys.shape[1]), dtype=torch.bool, device=hidden.device)
    mode = _BlockCandidates(k, key_index)
    with mode:
        indexer.forward(hidden, call["q_resid"], call["position_embeddings"], visible, None, cache=_BlockKeys(keys))
    if mode.candidates is None:
        raise RuntimeError(_NO_TOPK.format(indexer=type(indexer).__name__, layer=indexer.layer_idx))
    return mode.candidates


_NO_TOPK = (
    "The DSA indexer of layer {layer} ({indexer}) returned without a torch.topk of its index scores, which LongStraw "
    "extends over the prompt's keys: this transformers version's indexer is not supported."
)


class IndexerSelection(TorchFunctionMode):
    """Active during one indexer call of the model (entered and left by the indexer's forward hooks,
    `add_selection_hooks`): its `topk` of the index scores of the forward's own keys becomes the top-k
    over the prompt's keys and the own keys (`IndexerKeys.select`), in global key indices (the prompt's tokens first).

    It acts once, on the call's own scores only (`[batch, tokens, own keys]` of this call), and only while it is its
    indexer's current selection: a forward interrupted inside the indexer (`KeyboardInterrupt` skips the hook that
    leaves the mode) leaves a mode on the stack that lets every later `topk` through."""

    def __init__(self, layer: IndexerKeys, access, call: dict, own_index: torch.Tensor, k: int):
        super().__init__()
        self.layer, self.access, self.call, self.own_index, self.k = layer, access, call, own_index, k
        self.selected = False

    def _is_its_call(self, scores) -> bool:
        expected = (*self.call["hidden_states"].shape[:2], self.own_index.numel())
        current = getattr(self.layer.mixer, "_longstraw_selection", None) is self
        return current and not self.selected and isinstance(scores, torch.Tensor) and tuple(scores.shape) == expected

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _TOPK or not self._is_its_call(args[0]):
            return func(*args, **(kwargs or {}))
        values, ids = self.layer.select(self.access, self.call, args[0], self.own_index, self.k)
        self.selected = True
        return torch.return_types.topk((values, ids))


class IndexerKeys(LayerState):
    """`[1, tokens, index_head_dim]` DSA indexer keys of one index-computing layer."""

    name = "dsa_indexer"
    layer_types = (None, "full_attention", "sliding_attention", "indexed_attention")
    roles = frozenset({"indexer"})
    sharded_layer_types = layer_types
    differentiable = False
    extends_masks = True

    @classmethod
    def find_mixer(cls, layer, layer_type):
        for child in layer.children():
            if is_multi_head_latent_attention(child) and getattr(child, "indexer", None) is not None:
                return child.indexer
        return None

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        # in the model dtype under fp8 pages too: the keys decide a discrete selection
        return LayerAccount("dsa_indexer_keys", per_token=mixer.head_dim * dtype_bytes)

    @classmethod
    def index_heads(cls, mixer):
        return mixer.n_heads

    @classmethod
    def step_selection_elements(cls, mixer):
        return mixer.index_topk

    def __init__(self, mixer, layer_idx, layer_type, prompt):
        super().__init__(mixer, layer_idx, layer_type, prompt)
        self.keys = Pages(prompt.placement, prompt.num_tokens)
        add_selection_hooks(mixer)

    def tensors(self) -> list[torch.Tensor]:
        return self.keys.tensors()

    @torch.no_grad()
    def extend(self, access, keys: torch.Tensor) -> torch.Tensor:
        """The indexer keys the model's indexer scores in this forward: its own `keys [batch, tokens, dim]` (decoding:
        after the rows' earlier ones of their last suffix page, `Suffix.extend_last_page`), never the prompt's or the
        rows' earlier pages, which `select` visits block by block. A capture also writes them into the pages."""
        if access.mode == "capture":
            self.keys.append(keys[:1])
            return keys
        if access.suffix is None:
            return keys
        return access.suffix.extend_last_page(self, "keys", keys, dim=1)

    @torch.no_grad()
    def select(self, access, call: dict, own_scores: torch.Tensor, own_index: torch.Tensor, k: int):
        """The top-`k` `(scores, global key indices)` of one indexer call over the prompt's keys before this forward
        (this process's: `PromptState.local_prefix`) and the own keys the model scored (`own_scores`, columns
        `own_index`; `-1`: not counted here); under context parallelism, merged across the group
        (`PromptSharding.selection`)."""
        own_scores = own_scores.masked_fill(own_index < 0, float("-inf"))
        values, picked = own_scores.topk(min(k, own_scores.shape[-1]), dim=-1)
        best = values, own_index[picked]
        if access.suffix is not None and bool((own_index >= 0).any()):  # the rows' earlier pages, where counted
            for page, keys in enumerate(access.suffix.earlier_pages(self, "keys")):
                first = access.prefix_length + page * keys.shape[1]
                key_index = torch.arange(first, first + keys.shape[1], device=keys.device)
                best = merge_candidates(best, block_candidates(self.mixer, call, keys, key_index, k), k)
        limit = access.state.local_prefix(access.prefix_length)
        best = self.held_candidates(call, best, k, limit, access.attention_chunk_size)
        sharding = access.state.sharding
        return best if sharding is None else sharding.selection.finish_selection(access, self, best, k)

    def held_candidates(self, call: dict, best, k: int, limit: int, block: int):
        """`prompt_candidates` of the first `limit` pages held here and of every key held here of the states this
        one continues (a continuation: the prompt's keys, then its earlier segments')."""
        best = self.prompt_candidates(call, best, k, limit, block)
        parent = self.parent
        while parent is not None:
            best = parent.prompt_candidates(call, best, k, parent.keys.length, block)
            parent = parent.parent
        return best

    def prompt_candidates(self, call: dict, best, k: int, limit: int, block: int):
        """`best` (or nothing) merged with the top-`k` candidates (as global key indices) of the first `limit` pages
        for the queries of indexer `call`.

        The indexer is called over blocks of query rows x blocks of keys whose scores never outnumber those of all
        the call's rows against `block` keys (the `[tokens, index_heads, block]` bound), with the keys as wide as
        that allows up to `INDEXER_KEYS_PER_CALL` (or `block`, if larger): fewer rows per call, fewer calls per row,
        and so fewer reruns of the indexer's query side. A decoding step (one row) keeps blocks of `block` keys.
        Row blocks are balanced (no one-row remainder call).
        """
        if limit == 0:
            return best
        hidden = call["hidden_states"]
        tokens = hidden.shape[1]
        keys_per_call = min(limit, max(block, min(INDEXER_KEYS_PER_CALL, tokens * block)))
        rows = min(tokens, max(1, tokens * block // keys_per_call))
        rows = -(-tokens // -(-tokens // rows))  # as many row blocks as that needs, evened out
        row_blocks = [(start, min(start + rows, tokens)) for start in range(0, tokens, rows)]
        bests = [None if best is None else (best[0][:, a:b], best[1][:, a:b]) for a, b in row_blocks]

        def full(best) -> bool:  # a running top-k already k wide: a merge changes its values, not its shape
            return best is not None and best[0].shape[-1] == k

        def block_kind(start: int):  # key blocks are interchangeable once every row block's top-k is full
            return (min(start + keys_per_call, limit) - start) if all(full(best) for best in bests) else object()

        def row_kind(item):  # and row blocks once their own is
            index, (a, b) = item
            return (b - a) if full(bests[index]) else object()

        for start in visits(range(0, limit, keys_per_call), key=block_kind):
            end = min(start + keys_per_call, limit)
            keys = self.prompt.placement.stage(self.keys.read(end)[:, start:end], hidden.device)
            key_index = self.prompt.global_indices(start, end).to(hidden.device)
            for i, (a, b) in visits(enumerate(row_blocks), key=row_kind):
                candidates = block_candidates(self.mixer, _rows_of(call, a, b), keys, key_index, k)
                bests[i] = merge_candidates(bests[i], candidates, k)
        return torch.cat([b[0] for b in bests], dim=1), torch.cat([b[1] for b in bests], dim=1)


def _rows_of(call: dict, start: int, end: int) -> dict:
    """An indexer call's inputs for its query rows `start .. end - 1` (what `block_candidates` reads)."""
    cos, sin = call["position_embeddings"]
    return {
        "hidden_states": call["hidden_states"][:, start:end],
        "q_resid": call["q_resid"][:, start:end],
        "position_embeddings": (cos[:, start:end], sin[:, start:end]),
    }


def add_selection_hooks(indexer: torch.nn.Module) -> None:
    """Hook a DSA indexer once (idempotent) so that, in a forward carrying a `StateAccess` as its cache, its top-k
    covers the prompt's keys (`IndexerSelection`); any other forward (stock generation, evaluation) runs untouched.
    The hooks stay: an activation-checkpointed layer re-runs its indexer during the backward, with the same access."""
    if getattr(indexer, "_longstraw_selection_hooks", False):
        return
    indexer.register_forward_pre_hook(_indexer_called, with_kwargs=True)
    indexer.register_forward_hook(_indexer_returned, always_call=True)
    indexer._longstraw_selection_hooks = True


def _leave_interrupted_selection(module) -> None:
    """A forward interrupted inside this indexer (a `KeyboardInterrupt` skips the hook that leaves the mode) left its
    selection mode on the torch-function stack: inert (`IndexerSelection` lets every other call through), but every
    torch call pays for it in Python. Leave it, if it is still on top (nothing entered since)."""
    stale = getattr(module, "_longstraw_selection", None)
    # torch has no public API that reads the torch-function mode stack (`torch.overrides` exposes entering and
    # leaving a mode only), and leaving a mode that is not on top would pop another one: these two private calls
    # are the only way to tell.
    depth = torch._C._len_torch_function_stack()
    if stale is not None and depth > 0 and torch._C._get_function_stack_at(depth - 1) is stale:
        stale.__exit__(None, None, None)
    module._longstraw_selection = None


def _indexer_called(module, args, kwargs) -> None:
    _leave_interrupted_selection(module)
    call = indexer_call(module, args, kwargs)
    access = call.get("cache")
    if not isinstance(access, StateAccess) or access.output_unread(module.layer_idx):
        return  # a forward without prompt state, or a selection only the skipped attention would apply
    state, hidden = access.state, call["hidden_states"]
    tokens, decoded, earlier = hidden.shape[1], 0, 0
    if access.suffix is not None:  # the own keys: the rows' last suffix page, then this forward's
        decoded, earlier = access.suffix.length, access.suffix.last_page_length
    k = min(module.index_topk, access.prefix_length + decoded + tokens)  # as the indexer would over every key
    first = access.prefix_length + decoded - earlier
    own_index = torch.arange(first, first + earlier + tokens, device=hidden.device)
    sharding = state.sharding
    if sharding is not None:
        own_index = sharding.selection.own_keys(access, own_index)
    selection = IndexerSelection(state.for_mixer(module), access, call, own_index, k)
    if sharding is not None:  # every rank's inputs of this call, each rank scoring its keys for all
        sharding.selection.before_selection(access, call)
    module._longstraw_selection = selection  # the call in flight (indexer calls do not nest)
    selection.__enter__()


def _indexer_returned(module, args, output) -> None:
    selection = getattr(module, "_longstraw_selection", None)
    if selection is None:  # a forward without prompt state
        return
    selection.__exit__(None, None, None)
    module._longstraw_selection = None
    if not selection.selected:
        raise RuntimeError(
            f"The DSA indexer of layer {module.layer_idx} ({type(module).__name__}) returned without a torch.topk of "
            "its index scores, which LongStraw extends over the prompt's keys: this transformers version's indexer "
            "is not supported."
        )
