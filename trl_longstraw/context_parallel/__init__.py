"""Context parallelism: one group's prompt sharded by sequence across the ranks of a CP group.

Every rank of a CP group keeps the durable state of one contiguous shard of the captured prompt tokens, and nothing
of another rank's: a query's attention over a shard is computed where the shard lives, as that shard's partial
`(o, lse)`, and the partials are merged by log-sum-exp across the group, which is exact. One concept per module:

| module | owns |
| --- | --- |
| `communication.py` | the CP group and its collectives, the device they run on, `COMMUNICATION` counts, group building |
| `sharding.py` | which tokens each rank holds (contiguous shards), the capture's per-rank work, `ContextParallelError` |
| `merge.py` | the log-sum-exp merge of partial attention and its autograd function, the DSA top-k merge |
| `protocol.py` | the `Announcement` the owner of a shard sends to the serving ranks: one encode, one decode, checked |
| `state.py` | `ShardedPromptState`: a rank's shard, its attention across ranks, serving, the recurrent hand-off |
| `engine.py` | `ContextParallelEngine`: capture shard by shard, the exact-mode recompute, rollout decisions |
| `data.py` | the trainer's data side: the group's ranks train on the same rows; refusals before any hang |

Capture: shard by shard, in rank order. The owner of the current shard runs its chunks through the model; at each
attention layer but the last (whose attention a capture skips: `StateAccess.output_unread`, unless the MoE
load-balancing loss reads every layer's output) it announces the call and broadcasts the chunk's queries (one chunk:
`prefill_chunk_size` tokens), and every rank computes the partial attention of those queries over its own pages (the
owner over its pages so far plus the chunk's own keys, causal; a rank whose shard is not captured yet contributes
`lse = -inf`); the partials are merged on every rank. Meanwhile the other ranks serve, the matching loop, until the
owner announces the end of its shard (the exact-mode recompute runs the same way, shards in reverse order, the owner
also announcing each attention backward). Recurrent layers (GatedDeltaNet, Mamba2) are sequential: the owner of shard
r + 1 starts from shard r's final conv/recurrent states, sent point to point; after the last shard its final states
are broadcast, so that every rank's replay starts from the whole prompt's recurrent state. So no rank ever holds
another rank's pages, only one chunk of another rank's queries and one chunk-sized partial at a time.

Replay and scoring: every rank of the group runs the same member in lockstep; each attends over its own shard's
pages, the completion's own keys are counted on rank 0 of the group only, and the partials are merged by an
all-reduce of the max log-sum-exp and then of the weighted outputs. The backward sums the query-side gradients inside
the attention function, so every rank computes identical parameter gradients without any further all-reduce.

DSA (DeepSeek-V3.2, GLM-5): the top-k is selected over the whole prefix, never per shard. The model's own indexer runs
on every rank over that rank's indexer keys, block by block (`state/dsa.py`); each rank's top-k candidates, in global
key indices, are gathered by an all-reduce and the top-k of those taken, the same on every rank; the global top-k is
always among them, so this is exact. In a capture or recompute the owner announces each indexer call and the ranks
holding earlier shards run the indexer over theirs. A serving rank's partial attention applies the last merged
selection, as the model's IndexShare layers reuse the last computing layer's. Exactly tied index scores may be broken
differently than in one process, as between two chunkings of one process.

Rollouts (`rollout_from_prompt_state`): every rank decodes the group's rows in lockstep against its shard, each rank
keeping the rows' own decoded entries (counted on rank 0), and each step's sampled tokens and stopping decisions are
rank 0's (`ContextParallelEngine.agree`), so the ranks never drift apart.

Communication (elements all-reduced, per replayed token, per attention layer, `heads` query heads of width `d`,
`kv_heads` key heads, value width `dv`): forward `heads * (dv + 2)` (the max and the weighted sum with its weight),
backward `heads * d + kv_heads * (d + dv)` (dq and the own keys' and values' gradients), plus `heads` with sinks; and
per DSA indexer layer `2 * cp * k` (each rank's top-k candidate scores and key indices). `COMMUNICATION` counts what
actually went through the collectives (benchmarks/context_parallel.py checks one against the other).
"""

from .communication import (
    COMMUNICATION,
    ContextParallelGroup,
    build_context_parallel_group,
    communication_device,
)
from .data import SharedRowsSampler, check_same_rewards, check_same_rows, leader_rows, share_leader_inputs
from .engine import ContextParallelEngine
from .merge import ContextParallelAttention, merge_across, merge_topk
from .protocol import check_protocol
from .sharding import ContextParallelError, ShardLayout, capture_attention_pairs, check_prompt_length
from .state import ShardedPromptState

__all__ = [
    "COMMUNICATION",
    "ContextParallelAttention",
    "ContextParallelEngine",
    "ContextParallelError",
    "ContextParallelGroup",
    "ShardLayout",
    "ShardedPromptState",
    "SharedRowsSampler",
    "build_context_parallel_group",
    "capture_attention_pairs",
    "check_prompt_length",
    "check_protocol",
    "check_same_rewards",
    "check_same_rows",
    "communication_device",
    "leader_rows",
    "merge_across",
    "merge_topk",
    "share_leader_inputs",
]
