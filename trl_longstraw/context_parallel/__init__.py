"""Context parallelism: one group's prompt sharded by sequence across the ranks of a CP group, which share the work.

Every rank of a CP group keeps the durable state of its chunks of the captured prompt tokens (one chunk per capture
step, dealt in zigzag: `sharding.py`), and nothing of another rank's: a query's attention over a rank's pages is
computed where they live, as a partial `(o, lse)`, and the partials are merged by log-sum-exp, which is exact. One
concept per module:

| module | owns |
| --- | --- |
| `communication.py` | the CP group and its collectives, the device they run on, `COMMUNICATION` counts, group building |
| `sharding.py` | which tokens each rank holds (`ShardLayout`: chunks in zigzag), the capture's per-rank work |
| `step.py` | `StepAttention`: a capture or recompute step's attention, every rank's chunk at once; rows after the prompt |
| `merge.py` | the log-sum-exp merge of partials (on one rank, across the group), the DSA top-k merge |
| `protocol.py` | the protocol's version, compared across the group before its first capture |
| `state.py` | `PromptSharding`: a rank's chunks served across the group (the step attention, the top-k calls, the recurrent hand-offs) |
| `distribution.py` | `ContextParallel`, the engine's distribution: the capture's and recompute's steps, each rank's members, rollout decisions |
| `data.py` | the trainer's data side: the group's ranks train on the same rows; refusals before any hang |

Capture: step by step, every rank capturing its chunk of the step at once, layer by layer: at each attention (or
MLA) layer the step's queries, keys and values are all-gathered (one chunk per rank), each rank computes every query's
partial over its pages and the step's chunk pairs it is given (the same work on every rank), and the partials go to
their queries' ranks (all-to-all). The last layer's attention is skipped, as in one process
(`StateAccess.output_unread`). Recurrent layers (GatedDeltaNet, Mamba2) pass their conv and recurrent states from the
holder of a chunk to the holder of the next as each layer records them: a GatedDeltaNet chunk runs its rule from the
zero state meanwhile and adds its starting state's share when it arrives (state passing, state/linear_attention.py),
a Mamba2 chunk waits for them (a wavefront); the last chunk's final states are broadcast so that every rank's replay
starts from the whole prompt's. Exact mode's recompute runs the steps in
reverse the same way, under autograd: the step attention's backward gives the pages of earlier steps their gradients
where they live (before they are recomputed), and a chunk's starting recurrent states hand their gradient back to the
previous chunk's holder, layer by layer as the backward reaches them.

Scoring and replay: every rank scores and replays its own members (`ContextParallel.members`: member
`round * cp + rank`, a stand-in where the last round has fewer), attending over every rank's pages with the same step
attention (no chunks): each rank computes every rank's rows over its pages and its own rows over their own keys.
Scores are all-gathered, so every rank holds every member's log-probs; each rank's backward adds its members' part of
the parameter gradients and of the pages' (exact mode), and the trainer's one gradient reduction sums a CP group's
parts (`distributed.average_gradients(..., shares=cp)`).

DSA (DeepSeek-V3.2, GLM-5): the top-k is selected over the whole prefix, never per rank. Each rank runs the model's
indexer over its indexer keys, block by block (`state/dsa.py`), for every query of the step (or every rank's rows):
its top-k candidates, in global key indices, go to the queries' ranks, which take the top-k of all of them (the
global top-k is always among them: exact), and the selections are all-gathered for the attention that applies them;
IndexShare layers reuse the last selection, as the model does. Exactly tied index scores may be broken differently
than in one process, as between two chunkings of one process.

Rollouts (`rollout_from_prompt_state`): every rank decodes the group's rows in lockstep against its pages, each rank
keeping the rows' own decoded entries (counted on rank 0), merged across the group; each step's sampled tokens and
stopping decisions are rank 0's (`ContextParallel.agree`), so the ranks never drift apart.

Communication: `step.py` gives the elements per layer and token of each step and row forward and backward;
`COMMUNICATION` counts what actually went through the collectives (benchmarks/context_parallel.py checks one against
the other).
"""

from .communication import (
    COMMUNICATION,
    ContextParallelGroup,
    build_context_parallel_group,
    communication_device,
)
from .data import SharedRowsSampler, check_same_rewards, check_same_rows, leader_rows, share_leader_inputs
from .distribution import ContextParallel, distribution_over
from .merge import merge_across, merge_topk
from .protocol import check_protocol
from .sharding import ContextParallelError, ShardLayout, capture_attention_pairs, check_prompt_length
from .state import PromptSharding
from .step import StepAttention, StepCall

__all__ = [
    "COMMUNICATION",
    "ContextParallel",
    "ContextParallelError",
    "ContextParallelGroup",
    "PromptSharding",
    "ShardLayout",
    "SharedRowsSampler",
    "StepAttention",
    "StepCall",
    "build_context_parallel_group",
    "capture_attention_pairs",
    "check_prompt_length",
    "check_protocol",
    "check_same_rewards",
    "check_same_rows",
    "communication_device",
    "distribution_over",
    "leader_rows",
    "merge_across",
    "merge_topk",
    "share_leader_inputs",
]
